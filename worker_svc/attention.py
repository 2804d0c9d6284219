"""The attention backend seam: which ops store K/V and attend over the paged cache.

The model calls `backend.store_kv` and `backend.forward` and knows nothing else; the
runner builds one `AttentionMetadata` per step and hands it to every layer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels import cpu_attention, reference

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence may attend to."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, prefix sums of query lengths


class AttentionBackend(Protocol):
    name: str

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`key`, `value`: the step's own (what store_kv just wrote), which a backend may
        read instead of the cache where a sequence has no cached context; optional."""
        ...


class TorchAttentionBackend:
    """The plain-torch reference ops from `kernels/reference.py`; works on any device."""

    name = "torch"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        reference.store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return reference.paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            sliding_window=sliding_window,
        )


class CpuAttentionBackend(TorchAttentionBackend):
    """`kernels/cpu_attention.py`: the reference's math, arranged for CPU speed (the C
    decode kernel, batched SDPA for whole prompts, a C row copy into the cache)."""

    name = "cpu"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        cpu_attention.store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return cpu_attention.paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            sliding_window=sliding_window,
            key=key,
            value=value,
        )


def needs_triton_interpreter(backend: str, device: torch.device | str) -> bool:
    """Whether attention `backend` on `device` runs Triton's kernels in its interpreter
    (TRITON_INTERPRET=1): "triton" on CPU. "auto" never picks Triton on CPU."""
    return backend == "triton" and torch.device(device).type == "cpu"


class TritonAttentionBackend:
    """The Triton kernels (`kernels/attention.py`). On CPU they run in Triton's interpreter:
    correct, but far too slow for anything beyond tests.

    Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel modules
    are imported, so on CPU it must be set before that, by whoever starts the process: the
    worker's startup (`worker_svc/main.py`, from `needs_triton_interpreter`) or a test's
    conftest. This backend only checks. The kernel modules are imported here, not at module
    import, so the torch backend never loads Triton.
    """

    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            # Checked before the import: importing the kernels compiled would leave this
            # process unable to run them on CPU even once the variable is set.
            raise RuntimeError(
                "the 'triton' attention backend on CPU runs in Triton's interpreter, which "
                "needs TRITON_INTERPRET=1 set before the kernels are imported (the worker sets "
                "it at startup for --attention-backend triton on CPU); set it at process start "
                "or use attention_backend='cpu' or 'torch' on CPU"
            )
        try:
            from kernels import attention as ops
        except ImportError as error:
            raise RuntimeError(
                f"the 'triton' attention backend needs the triton package ({error}); install "
                "it or choose attention_backend='torch'"
            ) from error
        if device.type == "cpu" and not ops.runs_in_interpreter():
            raise RuntimeError(
                "the Triton kernels were already imported without "
                "TRITON_INTERPRET=1, so they cannot run on CPU in this process; "
                "use attention_backend='torch' on CPU"
            )
        if device.type == "cpu":
            logger.warning(
                "triton attention on CPU runs in Triton's interpreter "
                "(TRITON_INTERPRET=1): correct but very slow; use it for tests only"
            )
        self._ops = ops
        # The runner hands one metadata object to every layer of a step: split the batch into
        # decodes and prefills (a device sync) once per step, not once per layer.
        self._planned_for: AttentionMetadata | None = None
        self._plan = None
        self._graph_plans: dict[int, object] = {}  # CUDA graphs read their seq ids: keep them

    def fix_decode_plan(self, metadata: AttentionMetadata, num_seqs: int, max_seq_len: int) -> None:
        """Attend over `metadata` as `num_seqs` decodes of at most `max_seq_len` tokens, read
        from the device only: what a CUDA graph captures (worker_svc/cuda_graphs.py), whose
        replays cannot stop to read lengths on the host. A context shorter than assumed
        costs nothing: its partitions past the end return at once."""
        device = metadata.seq_lens.device
        plan = self._ops.AttentionPlan(
            decode_seq_ids=torch.arange(num_seqs, dtype=torch.int32, device=device),
            prefill_seq_ids=torch.empty(0, dtype=torch.int32, device=device),
            max_decode_seq_len=max_seq_len,
            max_prefill_query_len=0,
        )
        self._graph_plans[num_seqs] = plan
        self._plan, self._planned_for = plan, metadata

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        self._ops.store_kv(key, value, kv_cache[0], kv_cache[1], metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._planned_for is not metadata:
            self._plan = self._ops.plan_attention(
                metadata.seq_lens,
                metadata.query_start_loc,
                num_tokens=query.shape[0],
                block_tables=metadata.block_tables,
                block_size=kv_cache.shape[2],
            )
            self._planned_for = metadata
        return self._ops.paged_attention_planned(
            query,
            kv_cache[0],
            kv_cache[1],
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            self._plan,
            sliding_window=sliding_window,
        )


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """ "torch" (the reference ops) anywhere; "cpu" (the same math arranged for speed) on CPU;
    "triton" anywhere (on CPU through Triton's interpreter, for tests); "auto" is triton on
    CUDA, cpu on CPU and torch elsewhere."""
    device = torch.device(device)
    if name == "auto":
        name = {"cuda": "triton", "cpu": "cpu"}.get(device.type, "torch")
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"the 'cpu' attention backend runs on CPU only, not {device}")
        return CpuAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
