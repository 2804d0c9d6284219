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

Joining: rank 0 hosts a TCPStore at the group's master address; every rank connects, counts
itself in under the formation's tag (the scheduler's epoch) and, once all are in, creates
the process group from that store. Keys live under the tag, so a straggler of an earlier
formation on the same address cannot be counted in a later one, and a join can be called
off (`should_abort`) until the last rank arrived. `DistributedContext.reform` leaves a
(possibly broken) group and joins a new one in place: the model's layers keep the object.
A dead peer makes an op raise: gloo reports a closed connection at once when the peer's
process dies (its kernel closes the sockets), and a silent peer after the group's timeout.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from worker_svc.parallel import ParallelConfig, global_rank, tp_group_ranks

logger = logging.getLogger(__name__)

_STATUS_OK = 0
_STATUS_FAILED = 1
_HEADER_LEN = 4  # step_id, digest, num_tokens, status
_MASK64 = (1 << 64) - 1


_POLL_INTERVAL_S = 0.05  # how often a joining rank looks at the store
_PROBE_TIMEOUT_S = 0.5


class JoinAborted(RuntimeError):
    """A join was called off (`should_abort`) before every rank of the group arrived."""


class GroupStepError(RuntimeError):
    """A step could not run consistently across the engine group; no rank applied it."""


class GroupCommError(GroupStepError):
    """A collective or transfer failed: a peer died (connection closed) or stayed silent
    past the group's timeout. The group is unusable until it is re-formed."""


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


class DistributedContext:
    """This rank's process groups and the few communication ops the worker needs."""

    def __init__(self, parallel: ParallelConfig, device: torch.device | str = "cpu",
                 tp_group: dist.ProcessGroup | None = None, *, initialized: bool = False,
                 backend: str | None = None) -> None:
        self.parallel = parallel
        self.device = torch.device(device)
        self.backend = backend or default_backend(self.device)
        self.tp_group = tp_group
        self._initialized = initialized
        self._store: dist.Store | None = None  # rank 0's keeps the rendezvous server alive
        # Cumulative seconds, for metrics and benchmarks (on CUDA, NCCL ops are asynchronous:
        # these then measure the launch, not the transfer).
        self.tp_collective_time_s = 0.0  # all-reduce, all-gather, step agreement
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
            self._comm("all-reduce", lambda: dist.all_reduce(tensor, group=self.tp_group))
            self.tp_collective_time_s += time.perf_counter() - start_s
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's `tensor` along `dim`, in tp_rank order."""
        if self.parallel.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.parallel.tp_size)]
        start_s = time.perf_counter()
        self._comm("all-gather", lambda: dist.all_gather(parts, tensor, group=self.tp_group))
        self.tp_collective_time_s += time.perf_counter() - start_s
        return torch.cat(parts, dim=dim)

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
        self._comm("step agreement", lambda: dist.all_gather(parts, mine, group=self.tp_group))
        self.tp_collective_time_s += time.perf_counter() - start_s
        rows = [tuple(int(x) for x in part.tolist()) for part in parts]
        ranks = tp_group_ranks(self.parallel, self.parallel.pp_rank)
        if len({d for d, _ in rows}) > 1:
            listing = ", ".join(f"rank {r}: {format_digest(d)}" for r, (d, _) in zip(ranks, rows))
            raise StepMismatchError(f"stage {self.parallel.pp_rank}: tensor-parallel ranks got "
                                    f"different steps (digests {listing})")
        rejected = [r for r, (_, rank_ok) in zip(ranks, rows) if not rank_ok]
        if ok and rejected:
            raise StepMismatchError(f"stage {self.parallel.pp_rank}: ranks {rejected} rejected "
                                    f"step {format_digest(digest)} that this rank accepted")

    # --- pipeline parallel (between stages, same tp_rank) ----------------------------

    def _stage_peer(self, pp_rank: int) -> int:
        if not 0 <= pp_rank < self.parallel.pp_size or pp_rank == self.parallel.pp_rank:
            raise ValueError(f"stage {pp_rank} is not another stage of a "
                             f"{self.parallel.pp_size}-stage pipeline")
        return global_rank(self.parallel, pp_rank, self.parallel.tp_rank)

    def pp_send(self, tensors: list[torch.Tensor], dst_stage: int) -> None:
        """Blocking sends to the same tp_rank of stage `dst_stage`, in list order."""
        peer = self._stage_peer(dst_stage)
        start_s = time.perf_counter()
        def send() -> None:
            for tensor in tensors:
                dist.send(tensor.contiguous(), dst=peer)

        self._comm(f"send to rank {peer}", send)
        self.pp_send_time_s += time.perf_counter() - start_s

    def pp_recv(self, shapes: Sequence[Sequence[int]],
                dtype: torch.dtype | Sequence[torch.dtype], src_stage: int) -> list[torch.Tensor]:
        """Blocking receives from the same tp_rank of stage `src_stage`; one dtype for all
        tensors or one per shape."""
        peer = self._stage_peer(src_stage)
        dtypes = [dtype] * len(shapes) if isinstance(dtype, torch.dtype) else list(dtype)
        tensors = [torch.empty(tuple(shape), dtype=tensor_dtype, device=self.device)
                   for shape, tensor_dtype in zip(shapes, dtypes, strict=True)]

        def receive() -> None:
            for tensor in tensors:
                dist.recv(tensor, src=peer)

        start_s = time.perf_counter()
        self._comm(f"receive from rank {peer}", receive)
        self.pp_recv_time_s += time.perf_counter() - start_s
        return tensors

    def send_stage_output(self, step_id: int, digest: int, hidden: torch.Tensor | None,
                          residual: torch.Tensor | None) -> None:
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
        return torch.tensor([step_id, digest, num_tokens, status], dtype=torch.int64,
                            device=self.device)

    def _comm(self, what: str, op: Callable[[], object]) -> None:
        """Runs torch.distributed calls; their failure (a lost peer) becomes GroupCommError."""
        try:
            op()
            return
        except RuntimeError as exc:  # gloo and NCCL report a lost peer as a RuntimeError
            message = f"rank {self.parallel.rank}: {what} failed: {exc}"
        # Raised outside the handler so that torch's error is not chained: its traceback holds
        # the process group, through it rank 0's store, and so the port the next formation
        # reuses. (For the same reason `op` reads the group inside, not as an argument.)
        raise GroupCommError(message)

    def destroy(self) -> None:
        """Leave the process group; a broken one (a dead peer) is torn down all the same."""
        self.tp_group = None
        self._store = None
        if self._initialized and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group with a dead peer may fail to shut down cleanly
                logger.warning("error while leaving the process group", exc_info=True)
        self._initialized = False
        # Tracebacks of failed collectives can hold the old groups, and through them rank 0's
        # store server, whose port the next formation may reuse.
        gc.collect()

    def reform(self, master_addr: str, master_port: int, timeout_s: float,
               parallel: ParallelConfig | None = None, *, tag: str = "",
               should_abort: Callable[[], bool] | None = None) -> None:
        """Leave the current process group, broken or not, and join a new one at
        master_addr:master_port as `parallel`'s rank (default: the same place), mutating
        this object so everything holding it uses the new group. Weights and KV caches
        are untouched; the caller keeps them consistent with the (same) shard.

        Raises like `init_distributed`; after a failure the context holds no group and
        `reform` may be called again.
        """
        if (parallel or self.parallel).world_size == 1:
            raise ValueError("a single-rank group has no process group to re-form")
        self.destroy()
        if parallel is not None:
            self.parallel = parallel
        self._join(master_addr, master_port, timeout_s, tag, should_abort)

    def _join(self, master_addr: str, master_port: int, timeout_s: float, tag: str,
              should_abort: Callable[[], bool] | None) -> None:
        parallel = self.parallel
        timeout = timedelta(seconds=timeout_s)
        store, self._store = _rendezvous(parallel, master_addr, master_port, timeout_s, tag,
                                         should_abort or (lambda: False))
        kwargs = {}
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            kwargs["device_id"] = self.device  # eager NCCL init: errors show here, not mid-step
        dist.init_process_group(self.backend, store=store, rank=parallel.rank,
                                world_size=parallel.world_size, timeout=timeout, **kwargs)
        self._initialized = True
        if parallel.tp_size > 1:
            # new_group is collective over the whole world: every rank creates every stage's
            # group, in stage order, and keeps its own.
            for pp_rank in range(parallel.pp_size):
                group = dist.new_group(tp_group_ranks(parallel, pp_rank), timeout=timeout)
                if pp_rank == parallel.pp_rank:
                    self.tp_group = group
        logger.info("joined engine group%s as rank %d of %d (tp %d/%d, pp %d/%d) over %s",
                    f" (epoch {tag})" if tag else "", parallel.rank, parallel.world_size,
                    parallel.tp_rank, parallel.tp_size, parallel.pp_rank, parallel.pp_size,
                    self.backend)


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


def _rendezvous(parallel: ParallelConfig, master_addr: str, master_port: int, timeout_s: float,
                tag: str, should_abort: Callable[[], bool]) -> tuple[dist.Store, dist.Store]:
    """Every rank of `parallel`'s group at rank 0's store, counted in under `tag`.

    Returns (the tag's view of the store for init_process_group, the store itself).
    """
    deadline = time.monotonic() + timeout_s
    prefix = f"pagemesh/{tag}"
    opened = f"{prefix}/open"  # set by rank 0 on a fresh store: this formation's store
    while True:
        _check_join(should_abort, deadline, timeout_s, "reach the rendezvous store")
        store = _open_store(parallel, master_addr, master_port, timeout_s)
        if store is not None:
            try:
                if parallel.rank == 0:
                    store.set(opened, "1")
                    break
                if store.check([opened]):
                    break
            except dist.DistNetworkError as exc:
                # The earlier formation's store, closed between the connect and this look
                # (a rank-0 survivor leaving its old group): the new one comes next.
                logger.debug("rendezvous store at %s:%d went away: %s", master_addr,
                             master_port, exc)
            del store  # an earlier formation's store, not yet closed: wait for the new one
        time.sleep(_POLL_INTERVAL_S)
    arrived = f"{prefix}/arrived"
    store.add(arrived, 1)
    while store.add(arrived, 0) < parallel.world_size:
        try:
            _check_join(should_abort, deadline, timeout_s, "see every rank arrive")
        except (JoinAborted, TimeoutError):
            if _leave(store, arrived, parallel.world_size):
                raise
            break  # the last rank arrived meanwhile: the others count on this one now
        time.sleep(_POLL_INTERVAL_S)
    return dist.PrefixStore(prefix, store), store


def _open_store(parallel: ParallelConfig, master_addr: str, master_port: int,
                timeout_s: float) -> dist.Store | None:
    """Rank 0: the store server; other ranks: a client. None while that is not possible yet
    (the port still held by the previous formation, or nobody listening)."""
    timeout = timedelta(seconds=timeout_s)
    if parallel.rank == 0:
        try:
            return dist.TCPStore(master_addr, master_port, parallel.world_size, True, timeout,
                                 wait_for_workers=False)
        except dist.DistNetworkError as exc:
            # Still held by the last formation's store: an error's traceback kept its group.
            logger.debug("rendezvous port %d not free yet: %s", master_port, exc)
            gc.collect()
            return None
    # A plain probe first: a TCPStore client logs a stack trace for every failed attempt.
    try:
        socket.create_connection((master_addr, master_port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError:
        return None
    try:
        return dist.TCPStore(master_addr, master_port, parallel.world_size, False, timeout,
                             wait_for_workers=False)
    except dist.DistNetworkError as exc:
        logger.debug("rendezvous store at %s:%d not reachable yet: %s", master_addr,
                     master_port, exc)
        return None


def _leave(store: dist.Store, key: str, world_size: int) -> bool:
    """Uncount this rank, unless everyone already arrived (then the others rely on it)."""
    while True:
        current = store.get(key)
        if int(current) >= world_size:
            return False
        desired = str(int(current) - 1).encode()
        if store.compare_set(key, current, desired) == desired:
            return True


def _check_join(should_abort: Callable[[], bool], deadline: float, timeout_s: float,
                what: str) -> None:
    if should_abort():
        raise JoinAborted(f"join called off before it could {what}")
    if time.monotonic() > deadline:
        raise TimeoutError(f"could not {what} of the engine group within {timeout_s:g} s")
