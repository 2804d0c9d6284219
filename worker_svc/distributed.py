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
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
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


class GroupStepError(RuntimeError):
    """A step could not run consistently across the engine group; no rank applied it."""


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
                 tp_group: dist.ProcessGroup | None = None, *, initialized: bool = False) -> None:
        self.parallel = parallel
        self.device = torch.device(device)
        self.tp_group = tp_group
        self._initialized = initialized
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
            dist.all_reduce(tensor, group=self.tp_group)
            self.tp_collective_time_s += time.perf_counter() - start_s
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every TP rank's `tensor` along `dim`, in tp_rank order."""
        if self.parallel.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.parallel.tp_size)]
        start_s = time.perf_counter()
        dist.all_gather(parts, tensor, group=self.tp_group)
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
        dist.all_gather(parts, mine, group=self.tp_group)
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
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=peer)
        self.pp_send_time_s += time.perf_counter() - start_s

    def pp_recv(self, shapes: Sequence[Sequence[int]],
                dtype: torch.dtype | Sequence[torch.dtype], src_stage: int) -> list[torch.Tensor]:
        """Blocking receives from the same tp_rank of stage `src_stage`; one dtype for all
        tensors or one per shape."""
        peer = self._stage_peer(src_stage)
        dtypes = [dtype] * len(shapes) if isinstance(dtype, torch.dtype) else list(dtype)
        tensors = []
        start_s = time.perf_counter()
        for shape, tensor_dtype in zip(shapes, dtypes, strict=True):
            tensor = torch.empty(tuple(shape), dtype=tensor_dtype, device=self.device)
            dist.recv(tensor, src=peer)
            tensors.append(tensor)
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

    def destroy(self) -> None:
        if self._initialized and dist.is_initialized():
            dist.destroy_process_group()
        self._initialized = False
        self.tp_group = None


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
) -> DistributedContext:
    """Join the engine group's process group and build one TP group per stage.

    Every rank of the group must call this with the same address, port and sizes; rank 0
    (stage 0, tp_rank 0) hosts the rendezvous store at master_addr:master_port. Blocks
    until all `parallel.world_size` ranks joined (or `timeout_s` passed). `timeout_s`
    also bounds every later collective and receive, so a dead peer surfaces as an error.
    With world_size 1 nothing is initialised.
    """
    device = torch.device(device)
    if parallel.world_size == 1:
        return DistributedContext(parallel, device)
    backend = backend or default_backend(device)
    timeout = timedelta(seconds=timeout_s)
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    kwargs = {}
    if backend == "nccl":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # eager NCCL init: errors show here, not mid-step
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{master_port}", rank=parallel.rank,
        world_size=parallel.world_size, timeout=timeout, **kwargs,
    )
    tp_group = None
    if parallel.tp_size > 1:
        # new_group is collective over the whole world: every rank creates every stage's
        # group, in stage order, and keeps its own.
        for pp_rank in range(parallel.pp_size):
            group = dist.new_group(tp_group_ranks(parallel, pp_rank), timeout=timeout)
            if pp_rank == parallel.pp_rank:
                tp_group = group
    logger.info("joined engine group as rank %d of %d (tp %d/%d, pp %d/%d) over %s",
                parallel.rank, parallel.world_size, parallel.tp_rank, parallel.tp_size,
                parallel.pp_rank, parallel.pp_size, backend)
    return DistributedContext(parallel, device, tp_group, initialized=True)
