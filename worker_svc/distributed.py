"""torch.distributed for one engine group: a TP group per pipeline stage, p2p between stages.

Global rank = pp_rank * tp_size + tp_rank (see `parallel.py`). Tensor-parallel ranks of one
stage all-reduce / all-gather inside their stage's group; pipeline stages talk only
point to point, each tp_rank to the same tp_rank of the next stage, so stage s can run
step k + 1 while stage s + 1 is still on step k. Nothing here is a whole-world collective
per step: that would make every stage wait for the slowest and serialise the pipeline.

NCCL on CUDA, gloo on CPU; the same calls either way. With tp_size = pp_size = 1 no
process group exists at all (`DistributedContext.single()`): every op is a no-op.

Between stages each step travels as one int64 header `[step_id, digest, num_tokens,
status]` followed, when the sender succeeded and the step has tokens, by the hidden
states and the residual stream (`[num_tokens, hidden_size]` each, the model's dtype).
Exactly one header per step per (stage, tp_rank) pair, failure or not, so a receiver is
never left waiting and a sender never blocks on a payload nobody will read.

Joining, re-forming and leaving the groups (a rendezvous at rank 0's TCPStore, tagged with
the formation's epoch) is `process_groups.py`'s: `DistributedContext` is built on its
`ProcessGroupsMixin`, and `init_distributed` below joins a first group.

A dead peer makes an op raise: gloo reports a closed connection at once when the peer's
process dies (its kernel closes the sockets), and a silent peer after the group's timeout.
A frozen or cut-off peer closes nothing, so the group's timeout would be the only bound: a
rank told to leave its group (`abandon`, when the scheduler has declared a peer failed and
re-forms) stops waiting at once instead. Every op is waited on in short slices
(worker_svc/op_wait.py) and given up between two (gloo); on NCCL, `abandon` aborts the
communicators, which is what unblocks a collective stuck on a silent peer there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker_svc.op_wait import OpWaiter
from worker_svc.parallel import ParallelConfig, global_rank, tp_group_ranks
from worker_svc.process_groups import ProcessGroupsMixin

logger = logging.getLogger(__name__)

_STATUS_OK = 0
_STATUS_FAILED = 1
_HEADER_LEN = 4  # step_id, digest, num_tokens, status
_MASK64 = (1 << 64) - 1


class GroupStepError(RuntimeError):
    """A step could not run consistently across the engine group; no rank applied it."""


class GroupCommError(GroupStepError):
    """A collective or transfer failed: a peer died (connection closed) or stayed silent
    past the group's timeout. The group is unusable until it is re-formed."""


class GroupAbandoned(GroupCommError):
    """This rank was told to leave its group (`DistributedContext.abandon`) while an op
    waited for a peer: the scheduler declared a member failed and re-forms the group."""


class StepMismatchError(GroupStepError):
    """Ranks of one engine group were given different steps (or different step orders)."""


class UpstreamStageError(GroupStepError):
    """The previous pipeline stage failed this step, so this stage has nothing to run."""


@dataclass(frozen=True)
class StageMessage:
    """What the previous pipeline stage sent for one step."""

    step_id: int
    digest: int
    num_tokens: int
    failed: bool
    hidden: torch.Tensor | None  # [num_tokens, hidden_size]; None when failed or empty
    residual: torch.Tensor | None


def format_digest(digest: int) -> str:
    return f"{digest & _MASK64:016x}"


class DistributedContext(ProcessGroupsMixin):
    """This rank's process groups and the few communication ops the worker needs."""

    def __init__(
        self,
        parallel: ParallelConfig,
        device: torch.device | str = "cpu",
        *,
        backend: str | None = None,
    ) -> None:
        self.parallel = parallel
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        self.world: dist.Backend | None = None  # every rank of the engine group: p2p
        self.tp_group: dist.Backend | None = None  # this stage's tensor-parallel ranks
        # Rank 0's rendezvous server, (address, port, store): kept across formations.
        self._store_server: tuple[str, int, dist.TCPStore] | None = None
        # Told from another thread to make the op in progress, and every later one, give
        # up; reset when a new group is joined.
        self._waiter = OpWaiter()
        # Cumulative seconds, for metrics and benchmarks (on CUDA, NCCL ops are asynchronous:
        # these then measure the launch, not the transfer).
        self.tp_collective_time_s = 0.0  # all-reduce, all-gather, step agreement
        # Bytes this rank sent in tensor-parallel collectives: a ring all-reduce sends
        # 2 (n - 1) / n of the tensor, an all-gather (n - 1) / n of the result, an
        # all-to-all the rows it sends to other ranks (counts and step agreement left out).
        self.tp_bytes_sent = 0
        self.pp_send_time_s = 0.0
        self.pp_recv_time_s = 0.0  # includes waiting for the previous stage: the bubble

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> DistributedContext:
        """tp = pp = 1: no torch.distributed, every op below returns at once."""
        return cls(ParallelConfig(), device)

    @property
    def is_single(self) -> bool:
        return self.parallel.world_size == 1

    # --- tensor parallel (inside one stage) -------------------------------------------

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's TP ranks, in place; returns `tensor`."""
        if self.parallel.tp_size > 1:
            start_s = time.perf_counter()
            self._comm("all-reduce", lambda: [self._tp().allreduce([tensor])])
            self.tp_collective_time_s += time.perf_counter() - start_s
            n = self.parallel.tp_size
            self.tp_bytes_sent += 2 * (n - 1) * _nbytes(tensor) // n
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's `tensor` along `dim`, in tp_rank order."""
        if self.parallel.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.parallel.tp_size)]
        start_s = time.perf_counter()
        self._comm("all-gather", lambda: [self._tp().allgather([parts], [tensor])])
        self.tp_collective_time_s += time.perf_counter() - start_s
        self.tp_bytes_sent += (self.parallel.tp_size - 1) * _nbytes(tensor)
        return torch.cat(parts, dim=dim)

    def tp_all_to_all(
        self, tensor: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Rows [sum(send_counts), ...] go in tp_rank order, `send_counts[r]` of them to rank
        r; returns the rows every rank sent here, in tp_rank order, and how many from each
        (exchanged first, one count per pair of ranks, unless `recv_counts` says)."""
        if self.parallel.tp_size == 1:
            return tensor, list(send_counts)
        start_s = time.perf_counter()
        if recv_counts is None:
            sizes = torch.tensor(send_counts, dtype=torch.int64, device=tensor.device)
            received = torch.empty_like(sizes)
            ones = [1] * self.parallel.tp_size
            self._comm(
                "all-to-all counts",
                lambda: [
                    self._tp().alltoall_base(received, sizes, ones, ones, dist.AllToAllOptions())
                ],
            )
            recv_counts = received.tolist()
        tensor = tensor.contiguous()
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        self._comm(
            "all-to-all",
            lambda: [
                self._tp().alltoall_base(
                    out, tensor, recv_counts, list(send_counts), dist.AllToAllOptions()
                )
            ],
        )
        self.tp_collective_time_s += time.perf_counter() - start_s
        row_bytes = _nbytes(tensor[:1]) if tensor.shape[0] else 0
        self.tp_bytes_sent += row_bytes * (sum(send_counts) - send_counts[self.parallel.tp_rank])
        return out, recv_counts

    def tp_agree(self, digest: int, *, ok: bool = True) -> None:
        """Check that every TP rank of this stage runs the same step.

        `digest` is the step's digest, `ok` whether this rank could apply it. Raises
        StepMismatchError on every rank of the group when digests differ, or when some
        ranks could apply the step and others could not (those raise their own error).
        """
        if self.parallel.tp_size == 1:
            return
        mine = torch.tensor([digest, int(ok)], dtype=torch.int64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.parallel.tp_size)]
        start_s = time.perf_counter()
        self._comm("step agreement", lambda: [self._tp().allgather([parts], [mine])])
        self.tp_collective_time_s += time.perf_counter() - start_s
        rows = [tuple(int(x) for x in part.tolist()) for part in parts]
        ranks = tp_group_ranks(self.parallel, self.parallel.pp_rank)
        if len({d for d, _ in rows}) > 1:
            listing = ", ".join(f"rank {r}: {format_digest(d)}" for r, (d, _) in zip(ranks, rows))
            raise StepMismatchError(
                f"stage {self.parallel.pp_rank}: tensor-parallel ranks got "
                f"different steps (digests {listing})"
            )
        rejected = [r for r, (_, rank_ok) in zip(ranks, rows) if not rank_ok]
        if ok and rejected:
            raise StepMismatchError(
                f"stage {self.parallel.pp_rank}: ranks {rejected} rejected "
                f"step {format_digest(digest)} that this rank accepted"
            )

    # --- pipeline parallel (between stages, same tp_rank) ----------------------------

    def _stage_peer(self, pp_rank: int) -> int:
        if not 0 <= pp_rank < self.parallel.pp_size or pp_rank == self.parallel.pp_rank:
            raise ValueError(
                f"stage {pp_rank} is not another stage of a {self.parallel.pp_size}-stage pipeline"
            )
        return global_rank(self.parallel, pp_rank, self.parallel.tp_rank)

    def pp_send(self, tensors: list[torch.Tensor], dst_stage: int) -> None:
        """Blocking sends to the same tp_rank of stage `dst_stage`, in list order."""
        peer = self._stage_peer(dst_stage)
        start_s = time.perf_counter()
        self._comm(
            f"send to rank {peer}",
            lambda: [self._world().send([tensor.contiguous()], peer, 0) for tensor in tensors],
            p2p=True,
        )
        self.pp_send_time_s += time.perf_counter() - start_s

    def pp_recv(
        self,
        shapes: Sequence[Sequence[int]],
        dtype: torch.dtype | Sequence[torch.dtype],
        src_stage: int,
    ) -> list[torch.Tensor]:
        """Blocking receives from the same tp_rank of stage `src_stage`; one dtype for all
        tensors or one per shape."""
        peer = self._stage_peer(src_stage)
        dtypes = [dtype] * len(shapes) if isinstance(dtype, torch.dtype) else list(dtype)
        tensors = [
            torch.empty(tuple(shape), dtype=tensor_dtype, device=self.device)
            for shape, tensor_dtype in zip(shapes, dtypes, strict=True)
        ]

        start_s = time.perf_counter()
        self._comm(
            f"receive from rank {peer}",
            lambda: [self._world().recv([tensor], peer, 0) for tensor in tensors],
            p2p=True,
        )
        self.pp_recv_time_s += time.perf_counter() - start_s
        return tensors

    def send_stage_output(
        self, step_id: int, digest: int, hidden: torch.Tensor | None, residual: torch.Tensor | None
    ) -> None:
        """Hand one step's activations to the next stage (header only for an empty step)."""
        num_tokens = 0 if hidden is None else hidden.shape[0]
        header = self._header(step_id, digest, num_tokens, _STATUS_OK)
        payload = [] if hidden is None or num_tokens == 0 else [hidden, residual]
        self.pp_send([header, *payload], self.parallel.pp_rank + 1)

    def send_stage_failure(self, step_id: int, digest: int) -> None:
        """Tell the next stage this step failed here, so it raises instead of waiting."""
        header = self._header(step_id, digest, 0, _STATUS_FAILED)
        self.pp_send([header], self.parallel.pp_rank + 1)

    def recv_stage_input(self, hidden_size: int, dtype: torch.dtype) -> StageMessage:
        """The previous stage's message for the next step. Always reads the whole message
        (sized by its header), even one this stage will reject, so the sender never hangs."""
        src = self.parallel.pp_rank - 1
        (header,) = self.pp_recv([(_HEADER_LEN,)], torch.int64, src)
        step_id, digest, num_tokens, status = (int(x) for x in header.tolist())
        failed = status != _STATUS_OK
        hidden = residual = None
        if not failed and num_tokens > 0:
            hidden, residual = self.pp_recv([(num_tokens, hidden_size)] * 2, dtype, src)
        return StageMessage(step_id, digest, num_tokens, failed, hidden, residual)

    def _header(self, step_id: int, digest: int, num_tokens: int, status: int) -> torch.Tensor:
        return torch.tensor(
            [step_id, digest, num_tokens, status], dtype=torch.int64, device=self.device
        )

    def abandon(self) -> None:
        """Leave the group's ops: the one in progress (on another thread) raises
        GroupAbandoned within a wait slice, and so does every later one until a new group
        is joined. Called when the group re-forms without waiting for a peer that may never
        answer (frozen, or cut off from the network)."""
        self._waiter.abandon()
        if self.backend == "nccl":
            # NCCL ops do not wait on the CPU: aborting the communicators is what frees a
            # kernel stuck on a silent peer (the group is re-formed from scratch anyway).
            for group in (self.tp_group, self.world):
                if group is not None:
                    try:
                        group.abort()
                    except Exception:
                        logger.warning("aborting an NCCL communicator failed", exc_info=True)

    def _comm(self, what: str, start: Callable[[], list[dist.Work]], p2p: bool = False) -> None:
        """Starts torch.distributed ops (point-to-point ones with `p2p`) and waits for each
        so that `abandon` can end the wait; their failure (a lost peer) becomes
        GroupCommError."""
        error = self._run_ops(what, start, p2p)
        # Raised here, where no frame holds an op: a traceback that held torch's error or a
        # pending `Work` would keep the left process group alive. (For the same reason
        # `start` reads the group inside, not as an argument.)
        if error is not None:
            raise error

    def _run_ops(
        self, what: str, start: Callable[[], list[dist.Work]], p2p: bool
    ) -> GroupCommError | None:
        rank = self.parallel.rank
        if self._waiter.abandoned:
            return GroupAbandoned(f"rank {rank}: {what}: the group is being left")
        try:
            for work in start():
                if not self._waiter.wait(work, p2p):
                    return GroupAbandoned(
                        f"rank {rank}: {what} abandoned: the group is "
                        "re-forming without a peer this op waited for"
                    )
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as a RuntimeError
            return GroupCommError(f"rank {rank}: {what} failed: {exc}")
        return None

    def _world(self) -> dist.Backend:
        if self.world is None:
            raise GroupCommError(f"rank {self.parallel.rank}: not in a process group")
        return self.world

    def _tp(self) -> dist.Backend:
        if self.tp_group is None:
            raise GroupCommError(f"rank {self.parallel.rank}: not in a tensor-parallel group")
        return self.tp_group


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(
    parallel: ParallelConfig,
    master_addr: str,
    master_port: int,
    backend: str | None = None,
    timeout_s: float = 300.0,
    *,
    device: torch.device | str = "cpu",
    tag: str = "",
    should_abort: Callable[[], bool] | None = None,
) -> DistributedContext:
    """Join the engine group's process group and build one TP group per stage.

    Every rank of the group must call this with the same address, port, sizes and `tag`
    (the formation's epoch); rank 0 (stage 0, tp_rank 0) hosts the rendezvous store at
    master_addr:master_port. Blocks until all `parallel.world_size` ranks joined: raises
    TimeoutError after `timeout_s`, or JoinAborted as soon as `should_abort()` returns
    true while some rank is still missing. `timeout_s` also bounds every later collective
    and receive, so a silent peer surfaces as an error. With world_size 1 nothing is
    initialised.
    """
    device = torch.device(device)
    if parallel.world_size == 1:
        return DistributedContext(parallel, device)
    backend = backend or default_backend(device)
    if backend == "nccl" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    context = DistributedContext(parallel, device, backend=backend)
    context._join(master_addr, master_port, timeout_s, tag, should_abort)
    return context


def checked_context(
    parallel: ParallelConfig, device: str, dist: DistributedContext | None
) -> DistributedContext:
    """The context a runner placed at `parallel` on `device` steps in: `dist` when it agrees
    with them, a single-rank one for a group of one; ValueError naming the disagreement."""
    if dist is None:
        if parallel.world_size > 1:
            raise ValueError(
                f"{parallel} spans {parallel.world_size} ranks: pass this rank's "
                "DistributedContext from init_distributed"
            )
        return DistributedContext.single(device)

    def place(p: ParallelConfig) -> tuple[int, ...]:
        return (p.tp_size, p.tp_rank, p.pp_size, p.pp_rank)

    # The layer split may differ from the context's: it shapes the model, not the groups.
    if place(dist.parallel) != place(parallel):
        raise ValueError(
            f"runner config {parallel} does not match the process group's {dist.parallel}"
        )
    if dist.is_single:
        return DistributedContext.single(device)
    if dist.device.type != torch.device(device).type:
        raise ValueError(
            f"the process group was built for {dist.device} but the runner uses "
            f"{device}: pass device= to init_distributed (NCCL needs "
            "CUDA tensors, gloo CPU ones)"
        )
    return dist
