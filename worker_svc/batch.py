"""A step's bookkeeping on a worker: request state, step validation, the flat batch tensors,
and the step digest ranks compare.

Every rank of an engine group keeps the same request state and builds the same batch
from the same step, so pipeline stages agree on which row is which token without
sending any metadata along with the activations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from protos.step import (
    CachedRequestData,
    ImageInput,
    LoraRef,
    NewRequestData,
    PoolingParams,
    SamplingParams,
    SchedulerOutput,
)
from worker_svc.attention import AttentionMetadata
from worker_svc.model.pooling import PoolSegment
from worker_svc.structured import GrammarState


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + output known so far
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is in the cache
    sampling: SamplingParams
    # The sampling rank's grammar matcher (worker_svc/structured.py), made at the first draw
    # of a constrained request; None otherwise.
    grammar: GrammarState | None = None
    pooling: PoolingParams | None = None  # an embedding request: pooled, never sampled
    images: tuple[ImageInput, ...] = ()  # a vision-language prompt's images
    lora: LoraRef | None = None  # the LoRA adapter it runs with; None = the base model
    # This step's draft tokens (speculative decoding), computed after `token_ids`; cleared
    # after the step (the accepted ones come back as the next step's new tokens).
    draft_token_ids: list[int] = field(default_factory=list)

    def input_token_ids(self) -> list[int]:
        """The tokens the step may compute: the known ones, then this step's drafts."""
        return self.token_ids + self.draft_token_ids if self.draft_token_ids else self.token_ids


@dataclass(frozen=True)
class ImageSegment:
    """Rows of this step's batch that one image's embeddings fill: `count` rows from
    `start_row`, the image's embedding rows from `first` on."""

    image: ImageInput
    start_row: int
    first: int
    count: int


@dataclass(frozen=True)
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    # Flat token rows whose hidden states feed the LM head, and the request of each: one row
    # per request whose known tokens are all computed, plus one per draft it verifies (its
    # rows are consecutive, in position order).
    sample_rows: list[int]
    sample_request_ids: list[str]
    pool_segments: list[PoolSegment] = field(default_factory=list)  # embedding requests' rows
    image_segments: list[ImageSegment] = field(default_factory=list)  # rows an image fills


def batch_order(num_scheduled_tokens: dict[str, int]) -> list[str]:
    """Request ids in row order: sorted, so that every rank lays the batch out alike even
    if the step's map reached it in another order (protobuf maps keep none)."""
    return sorted(num_scheduled_tokens)


class BlockTables:
    """Every request's block table in one persistent numpy array, updated from the step diff
    (a new request's blocks, a cached one's new blocks, a finished one's row freed), so that
    a step's slot mapping and block tables are a few vectorized gathers instead of list
    conversions per request per step. Row i of `table` holds request `rows[id]`'s block ids,
    zero past its last (the padding block_tables always had)."""

    def __init__(self, num_rows: int = 64, width: int = 16) -> None:
        self.table = np.zeros((num_rows, width), dtype=np.int32)
        self.lengths = np.zeros(num_rows, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def set(self, request_id: str, block_ids: list[int]) -> None:
        """A new (or rebuilt) request's whole block list."""
        row = self.rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow_rows()
            row = self.rows[request_id] = self._free.pop()
        self.table[row] = 0
        self.lengths[row] = 0
        self.extend(request_id, block_ids)

    def extend(self, request_id: str, block_ids: list[int]) -> None:
        if not block_ids:
            return
        row = self.rows[request_id]
        start = int(self.lengths[row])
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            wider = np.zeros(
                (self.table.shape[0], max(end, 2 * self.table.shape[1])), dtype=np.int32
            )
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        self.table[row, start:end] = block_ids
        self.lengths[row] = end

    def remove(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def clear(self) -> None:
        for request_id in list(self.rows):
            self.remove(request_id)

    def _grow_rows(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free.extend(range(2 * old - 1, old - 1, -1))


def build_batch(
    requests: dict[str, RequestState],
    num_scheduled_tokens: dict[str, int],
    block_size: int,
    device: torch.device,
    tables: BlockTables,
) -> StepBatch:
    """The step's flat batch. Per request only its counts are read in Python; positions,
    slots and block tables are vectorized over `tables` (which must hold every scheduled
    request's blocks)."""
    order = batch_order(num_scheduled_tokens)
    states = [requests[request_id] for request_id in order]
    counts = np.fromiter((num_scheduled_tokens[r] for r in order), dtype=np.int64, count=len(order))
    starts = np.fromiter((s.num_computed_tokens for s in states), dtype=np.int64, count=len(order))
    ends = starts + counts
    query_start_loc = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    if bool((counts == 1).all()):  # decodes: one known token each
        input_ids = np.fromiter(
            (s.token_ids[start] for s, start in zip(states, starts.tolist())),
            dtype=np.int64,
            count=len(order),
        )
        positions = starts
        seq_of_token = np.arange(len(order))
    else:
        input_ids = np.concatenate(
            [
                np.asarray(s.input_token_ids()[a:b], dtype=np.int64)
                for s, a, b in zip(states, starts.tolist(), ends.tolist())
            ]
        )
        seq_of_token = np.repeat(np.arange(len(order)), counts)
        positions = starts[seq_of_token] + (
            np.arange(len(input_ids)) - query_start_loc[:-1][seq_of_token]
        )
    rows = np.fromiter((tables.rows[r] for r in order), dtype=np.int64, count=len(order))
    slots = (
        tables.table[rows[seq_of_token], positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    needed = -(-ends // block_size)  # blocks each sequence's context spans
    max_blocks = int(needed.max())
    # Blocks allocated ahead of the context read as 0, the padding they always had.
    block_tables = np.where(
        np.arange(max_blocks)[None, :] < needed[:, None], tables.table[rows, :max_blocks], 0
    ).astype(np.int32)
    drafts = np.fromiter((len(s.draft_token_ids) for s in states), dtype=np.int64, count=len(order))
    known = (
        np.fromiter((len(s.token_ids) for s in states), dtype=np.int64, count=len(order)) + drafts
    )
    completes = ends == known
    pool_segments = _pool_segments(order, states, query_start_loc, starts, counts, completes)
    if pool_segments:
        completes &= np.fromiter((s.pooling is None for s in states), dtype=bool, count=len(order))
    sampled = np.flatnonzero(completes)

    sample_rows = (query_start_loc[1:][sampled] - 1).tolist()
    sample_request_ids = [order[i] for i in sampled.tolist()]
    if drafts.any():  # each draft's row, and the row before the first, is drawn from too
        sample_rows, sample_request_ids = [], []
        for i in sampled.tolist():
            last = int(query_start_loc[i + 1]) - 1
            sample_rows += range(last - int(drafts[i]), last + 1)
            sample_request_ids += [order[i]] * (int(drafts[i]) + 1)

    def to_device(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(array, dtype=dtype).to(device)

    metadata = AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64),
        block_tables=to_device(block_tables, torch.int32),
        seq_lens=to_device(ends, torch.int32),
        query_start_loc=to_device(query_start_loc, torch.int32),
    )
    return StepBatch(
        input_ids=to_device(input_ids, torch.int64),
        positions=to_device(positions, torch.int64),
        metadata=metadata,
        sample_rows=sample_rows,
        sample_request_ids=sample_request_ids,
        pool_segments=pool_segments,
        image_segments=_image_segments(states, query_start_loc, starts, ends),
    )


def _image_segments(
    states: list[RequestState], query_start_loc: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> list[ImageSegment]:
    """The part of each image's placeholder positions this step computes, as batch rows."""
    segments = []
    for i, state in enumerate(states):
        for image in state.images:
            low = max(int(starts[i]), image.offset)
            high = min(int(ends[i]), image.offset + image.length)
            if low < high:
                segments.append(
                    ImageSegment(
                        image,
                        int(query_start_loc[i]) + low - int(starts[i]),
                        low - image.offset,
                        high - low,
                    )
                )
    return segments


def _pool_segments(
    order: list[str],
    states: list[RequestState],
    query_start_loc: np.ndarray,
    starts: np.ndarray,
    counts: np.ndarray,
    completes: np.ndarray,
) -> list[PoolSegment]:
    """The embedding requests' rows of the batch (none in a generation-only step)."""
    return [
        PoolSegment(
            order[i],
            int(query_start_loc[i]),
            int(counts[i]),
            int(starts[i]),
            bool(completes[i]),
            state.pooling.dimensions,
        )
        for i, state in enumerate(states)
        if state.pooling is not None
    ]


def step_digest(step: SchedulerOutput) -> int:
    """A stable signed 64-bit digest of everything that shapes the step's batch and state.

    blake2b, never Python's `hash()` (salted per process). Costs O(size of the step
    message), the same as decoding it.
    """
    digest = hashlib.blake2b(digest_size=8)

    def add(*items: object) -> None:
        digest.update(repr(items).encode())

    add(step.step_id, sorted(step.num_scheduled_tokens.items()), sorted(step.finished_request_ids))
    for new in step.new_requests:
        add(new.request_id, new.num_prompt_tokens, new.num_computed_tokens, new.block_ids, new.lora)
        digest.update(np.asarray(new.token_ids, dtype=np.int64).tobytes())
    for cached in step.cached_requests:
        add(
            cached.request_id,
            cached.num_computed_tokens,
            cached.new_block_ids,
            cached.new_token_ids,
            cached.spec_token_ids,
        )
    add(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)
    return int.from_bytes(digest.digest(), "little", signed=True)


def highest_block(step: SchedulerOutput) -> int:
    """The highest KV block id the step's requests were given (-1: none)."""
    ids = [max(r.block_ids) for r in step.new_requests if r.block_ids]
    ids += [max(r.new_block_ids) for r in step.cached_requests if r.new_block_ids]
    return max(ids, default=-1)


def validate_step(
    step: SchedulerOutput,
    requests: dict[str, RequestState],
    *,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    vocab_size: int,
) -> None:
    """Raise ValueError if `step` does not fit `requests`; reads, never writes, the state.

    Checks the step as it will be applied: finished ids dropped first, then new requests
    added (replacing any same id), then cached ones extended.
    """
    finished = set(step.finished_request_ids)
    shapes = {
        request_id: _Shape(len(state.token_ids), len(state.block_ids), state.num_computed_tokens)
        for request_id, state in requests.items()
        if request_id not in finished
    }
    new_ids = {new.request_id for new in step.new_requests}
    if len(new_ids) != len(step.new_requests):
        raise ValueError("a request id appears twice among new requests")
    for new in step.new_requests:
        shapes[new.request_id] = _new_request_shape(new, num_blocks, vocab_size)
    cached_ids: set[str] = set()
    for cached in step.cached_requests:
        request_id = cached.request_id
        if request_id in new_ids or request_id in cached_ids:
            raise ValueError(f"request {request_id!r} is listed twice in one step")
        if request_id not in shapes:
            raise ValueError(f"unknown request {request_id!r} in cached requests")
        cached_ids.add(request_id)
        shapes[request_id] = _cached_request_shape(
            cached, shapes[request_id], num_blocks, vocab_size
        )
    for request_id, num_tokens in step.num_scheduled_tokens.items():
        if request_id not in shapes:
            raise ValueError(f"unknown request {request_id!r} scheduled")
        _check_scheduled(request_id, num_tokens, shapes[request_id], block_size, max_model_len)


def check_block_moves(step: SchedulerOutput, num_blocks: int, num_swap_blocks: int) -> None:
    """Raise ValueError if a block move names a block outside the device cache or swap space."""
    for name, pairs, src_limit, dst_limit in (
        ("swap-out", step.blocks_to_swap_out, num_blocks, num_swap_blocks),
        ("swap-in", step.blocks_to_swap_in, num_swap_blocks, num_blocks),
        ("copy", step.blocks_to_copy, num_blocks, num_blocks),
    ):
        for src, dst in pairs:
            if not (0 <= src < src_limit and 0 <= dst < dst_limit):
                raise ValueError(
                    f"{name} of block {src} -> {dst} is outside the cache "
                    f"({num_blocks} device blocks, {num_swap_blocks} swap blocks)"
                )


@dataclass(frozen=True)
class _Shape:
    """A request's sizes once the step's updates are applied."""

    num_known_tokens: int  # with this step's drafts
    num_blocks_held: int
    num_computed_tokens: int
    num_drafts: int = 0


def _check_block_ids(request_id: str, block_ids: list[int], num_blocks: int) -> None:
    bad = [b for b in block_ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"request {request_id!r}: block ids {bad[:5]} outside 0..{num_blocks - 1}")


def _new_request_shape(new: NewRequestData, num_blocks: int, vocab_size: int) -> _Shape:
    request_id, num_known = new.request_id, len(new.token_ids)
    if not 0 < new.num_prompt_tokens <= num_known:
        raise ValueError(
            f"request {request_id!r}: num_prompt_tokens "
            f"{new.num_prompt_tokens} not in 1..{num_known}"
        )
    if not 0 <= new.num_computed_tokens <= num_known:
        raise ValueError(
            f"request {request_id!r}: num_computed_tokens "
            f"{new.num_computed_tokens} not in 0..{num_known}"
        )
    # An out-of-range id would index past the embedding (a device assert on CUDA).
    if any(not 0 <= t < vocab_size for t in new.token_ids):
        raise ValueError(f"request {request_id!r}: token id outside 0..{vocab_size - 1}")
    _check_block_ids(request_id, new.block_ids, num_blocks)
    for image in new.images:
        if image.length <= 0 or image.offset < 0 or image.offset + image.length > num_known:
            raise ValueError(
                f"request {request_id!r}: an image's {image.length} placeholders "
                f"at {image.offset} fall outside its {num_known} tokens"
            )
    return _Shape(num_known, len(new.block_ids), new.num_computed_tokens)


def _cached_request_shape(
    cached: CachedRequestData, shape: _Shape, num_blocks: int, vocab_size: int
) -> _Shape:
    _check_block_ids(cached.request_id, cached.new_block_ids, num_blocks)
    if any(not 0 <= t < vocab_size for t in cached.new_token_ids):
        raise ValueError(f"request {cached.request_id!r}: new token id outside 0..{vocab_size - 1}")
    num_known = shape.num_known_tokens + len(cached.new_token_ids)
    if not 0 <= cached.num_computed_tokens <= num_known:
        raise ValueError(
            f"request {cached.request_id!r}: num_computed_tokens "
            f"{cached.num_computed_tokens} not in 0..{num_known}"
        )
    num_drafts = len(cached.spec_token_ids)
    if num_drafts and any(not 0 <= t < vocab_size for t in cached.spec_token_ids):
        raise ValueError(
            f"request {cached.request_id!r}: draft token id outside 0..{vocab_size - 1}"
        )
    return _Shape(
        num_known + num_drafts,
        shape.num_blocks_held + len(cached.new_block_ids),
        cached.num_computed_tokens,
        num_drafts,
    )


def _check_scheduled(
    request_id: str, num_tokens: int, shape: _Shape, block_size: int, max_model_len: int
) -> None:
    end = shape.num_computed_tokens + num_tokens
    if num_tokens < 1:
        raise ValueError(f"request {request_id!r}: {num_tokens} tokens scheduled (need >= 1)")
    if end > shape.num_known_tokens:
        raise ValueError(
            f"request {request_id!r}: {num_tokens} tokens scheduled from "
            f"{shape.num_computed_tokens} but only {shape.num_known_tokens} "
            "tokens are known"
        )
    if shape.num_drafts and end != shape.num_known_tokens:
        raise ValueError(
            f"request {request_id!r}: its {shape.num_drafts} draft tokens must "
            "be scheduled to their end"
        )
    if end > max_model_len:
        raise ValueError(
            f"request {request_id!r}: {end} tokens exceed max_model_len {max_model_len}"
        )
    if shape.num_blocks_held * block_size < end:
        raise ValueError(
            f"request {request_id!r}: {shape.num_blocks_held} blocks of "
            f"{block_size} cannot hold {end} tokens"
        )
