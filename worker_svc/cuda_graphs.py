"""CUDA graphs for decode steps, as vLLM, SGLang and nano-vllm capture them.

A decode step launches a few hundred small kernels (per layer: norms, projections, RoPE,
the KV write, attention, the MLP); at small batches the GPU waits on the CPU launching
them. A CUDA graph records one forward's launches and replays them with one call.

- **Buckets**: a graph is captured per batch size in `capture_sizes` (vLLM's 1, 2, 4, then
  every multiple of 8 up to the largest batch the scheduler sends, at most 512). A step of
  n decodes replays the smallest graph of at least n rows: its inputs are copied into the
  graphs' static buffers, and the n..size rows padded with a sequence that stores nothing
  (slot -1) and attends to one key of block 0; their outputs are never read.
- **When**: at start-up, after the KV cache is allocated (the graphs read its addresses),
  largest first, all in one memory pool. Attention reads the lengths from device buffers
  and splits every context as if it were `max_model_len` long (partitions past a sequence's
  end return at once), so no graph depends on a step's lengths.
- **Eager steps** (`eager_reason`): any prefill or chunk (a request with more than one new
  token), a batch larger than the largest graph, a later pipeline stage (its input comes
  over the stage channel), and every step of a backend that cannot be captured (only the
  Triton backend reads everything it needs from the device).

The sizes, the bucketing, the eligibility and the padding are plain code tested on CPU
(tests/worker_svc/test_cuda_graphs.py runs a padded batch through the model there and
compares it with the unpadded one); capture and replay run on a GPU in bench/gpu_check.sh.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from worker_svc.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default largest graph
PAD_SLOT = -1  # the KV write skips the padded rows


def capture_sizes(max_num_seqs: int, max_size: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, then every multiple of 8, up to
    min(max_num_seqs, max_size), which is always one of them."""
    limit = min(max_num_seqs, max_size)
    if limit < 1:
        raise ValueError(
            f"CUDA graphs need a batch of at least 1, got max_num_seqs "
            f"{max_num_seqs}, max_size {max_size}"
        )
    sizes = [s for s in (1, 2, 4) if s <= limit] + list(range(8, limit + 1, 8))
    if sizes[-1] != limit:
        sizes.append(limit)
    return tuple(sizes)


def parse_capture_sizes(text: str) -> tuple[int, ...]:
    """`--cuda-graph-sizes 1,2,4,8,16`: sorted, without repeats; ValueError when a part is
    not a positive integer."""
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--cuda-graph-sizes must be positive integers separated by commas, got {text!r}"
        ) from None
    if not sizes or sizes[0] < 1:
        raise ValueError(
            f"--cuda-graph-sizes must be positive integers separated by commas, got {text!r}"
        )
    return tuple(sizes)


def bucket(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def eager_reason(
    num_scheduled_tokens: Mapping[str, int], sizes: Sequence[int], *, later_stage: bool = False
) -> str | None:
    """Why this step runs without a graph, or None when one replays it."""
    if not sizes:
        return "no graphs were captured"
    if not num_scheduled_tokens:
        return "no tokens to compute"
    if later_stage:
        return "a later pipeline stage (its input is the previous stage's hidden states)"
    longest = max(num_scheduled_tokens.values())
    if longest != 1:
        return f"a prefill or chunk ({longest} new tokens in one request)"
    if len(num_scheduled_tokens) > sizes[-1]:
        return f"{len(num_scheduled_tokens)} decodes, more than the largest graph ({sizes[-1]})"
    return None


class StaticDecodeInputs:
    """The graphs' input buffers, `max_size` rows each, on the model's device; the graph of
    size s reads rows [0, s). `load` copies a decode batch in and pads the rest of the
    bucket; `metadata(s)` views the first s rows (the object a graph captured with)."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self.max_size = max_size
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), PAD_SLOT, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(
            max_size, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        # One query token per row, always: a constant.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self._metadata: dict[int, AttentionMetadata] = {}

    def metadata(self, size: int) -> AttentionMetadata:
        if size not in self._metadata:
            self._metadata[size] = AttentionMetadata(
                slot_mapping=self.slot_mapping[:size],
                block_tables=self.block_tables[:size],
                seq_lens=self.seq_lens[:size],
                query_start_loc=self.query_start_loc[: size + 1],
            )
        return self._metadata[size]

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        size: int,
    ) -> None:
        """Rows [0, n) from a decode batch of n tokens (one per sequence), rows [n, size)
        the padding: token 0 at position 0, stored nowhere, a context of one key."""
        n = input_ids.shape[0]
        if not 0 < n <= size <= self.max_size:
            raise ValueError(
                f"a batch of {n} decodes does not fit a graph of {size} rows "
                f"(at most {self.max_size})"
            )
        width = metadata.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(
                f"block tables of {width} blocks are wider than the graphs' "
                f"{self.block_tables.shape[1]} (max_model_len / block_size)"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(PAD_SLOT)
            self.block_tables[n:size].zero_()
            self.seq_lens[n:size].fill_(1)


Forward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]


class DecodeGraphs:
    """One captured forward per size in `sizes`, over `inputs`; CUDA only.

    `forward(input_ids, positions, metadata)` is the model's forward with its KV cache and
    attention backend bound; `fix_plan(metadata, size)` makes the backend attend over
    `metadata` without reading lengths on the host (the Triton backend's `fix_decode_plan`).
    """

    def __init__(
        self,
        forward: Forward,
        fix_plan: Callable[[AttentionMetadata, int], None],
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        device: torch.device | str,
    ) -> None:
        self.sizes = tuple(sorted(sizes))
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks_per_seq, device)
        self._forward = forward
        self._fix_plan = fix_plan
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.capture_s = 0.0

    def capture(self) -> None:
        """Capture every size, largest first into one shared pool (the smaller graphs reuse
        the largest one's memory). Runs each size once eagerly first (warm-up on a side
        stream, as torch asks: lazy initializations must not happen inside a capture)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            metadata = self.inputs.metadata(size)
            self._fix_plan(metadata, size)
            args = (self.inputs.input_ids[:size], self.inputs.positions[:size], metadata)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, residual = self._forward(*args)
            self._graphs[size] = (graph, hidden, residual)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs for decode (batch sizes %s) in %.1f s",
            len(self.sizes),
            ",".join(map(str, self.sizes)),
            self.capture_s,
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the bucket's graph for a decode batch; its (hidden, residual) rows [0, n),
        views of the graph's output buffers (valid until the next replay)."""
        n = input_ids.shape[0]
        size = bucket(n, self.sizes)
        if size is None or size not in self._graphs:
            raise ValueError(f"no captured graph holds {n} decodes (sizes {self.sizes})")
        self.inputs.load(input_ids, positions, metadata, size)
        graph, hidden, residual = self._graphs[size]
        graph.replay()
        return hidden[:n], residual[:n]
