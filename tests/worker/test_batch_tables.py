"""The step batch gathered from persistent block tables (worker_svc/batch.py) equals the
plain per-request construction below, over random step histories: new requests, chunked
prefills, decodes, new blocks, finished requests, rows reused and tables grown."""

from __future__ import annotations

import random

import numpy as np
import torch

from worker_svc.batch import BlockTables, RequestState, batch_order, build_batch
from worker_svc.types import SamplingParams

BLOCK_SIZE = 4


def padded(rows: list[list[int]]) -> list[list[int]]:
    """Block rows padded with block 0 to the longest."""
    width = max(map(len, rows))
    return [row + [0] * (width - len(row)) for row in rows]


def plain_batch(requests: dict[str, RequestState], num_scheduled: dict[str, int]) -> dict:
    """The definition: one request at a time, lists and small arrays."""
    input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    rows, sample_rows, sample_ids = [], [], []
    for request_id in batch_order(num_scheduled):
        state, n = requests[request_id], num_scheduled[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        for pos in range(start, end):
            input_ids.append(state.token_ids[pos])
            positions.append(pos)
            slots.append(state.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        rows.append(state.block_ids[: -(-end // BLOCK_SIZE)])
        if end == len(state.token_ids):
            sample_rows.append(starts[-1] - 1)
            sample_ids.append(request_id)
    return {"input_ids": input_ids, "positions": positions, "slots": slots,
            "seq_lens": seq_lens, "query_start_loc": starts, "block_tables": padded(rows),
            "sample_rows": sample_rows, "sample_request_ids": sample_ids}


def per_request_batch(requests: dict[str, RequestState], num_scheduled: dict[str, int]) -> dict:
    """How the runner built batches before the block tables: numpy per request, each
    request's block list converted every step (`bench/worker_ops.py` times both)."""
    input_ids, positions, slots, seq_lens, starts, rows = [], [], [], [], [0], []
    sample_rows, sample_ids = [], []
    for request_id in batch_order(num_scheduled):
        state, n = requests[request_id], num_scheduled[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        token_positions = np.arange(start, end)
        block_ids = np.asarray(state.block_ids, dtype=np.int64)
        input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        positions.append(token_positions)
        slots.append(block_ids[token_positions // BLOCK_SIZE] * BLOCK_SIZE
                     + token_positions % BLOCK_SIZE)
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        rows.append(state.block_ids[: -(-end // BLOCK_SIZE)])
        if end == len(state.token_ids):
            sample_rows.append(starts[-1] - 1)
            sample_ids.append(request_id)
    return {"input_ids": np.concatenate(input_ids).tolist(),
            "positions": np.concatenate(positions).tolist(),
            "slots": np.concatenate(slots).tolist(), "seq_lens": seq_lens,
            "query_start_loc": starts, "block_tables": padded(rows),
            "sample_rows": sample_rows, "sample_request_ids": sample_ids}


def as_dict(batch) -> dict:
    m = batch.metadata
    return {"input_ids": batch.input_ids.tolist(), "positions": batch.positions.tolist(),
            "slots": m.slot_mapping.tolist(), "seq_lens": m.seq_lens.tolist(),
            "query_start_loc": m.query_start_loc.tolist(),
            "block_tables": m.block_tables.tolist(), "sample_rows": batch.sample_rows,
            "sample_request_ids": batch.sample_request_ids}


def test_batches_from_persistent_tables_equal_the_plain_construction():
    rng = random.Random(0)
    requests: dict[str, RequestState] = {}
    tables = BlockTables(num_rows=2, width=2)  # small, so rows and columns must grow
    next_block, next_id = 0, 0
    for _ in range(300):
        for request_id in [r for r in requests if rng.random() < 0.08]:
            del requests[request_id]
            tables.remove(request_id)
        while len(requests) < rng.randrange(1, 12):
            next_id += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
            blocks = list(range(next_block, next_block + -(-len(prompt) // BLOCK_SIZE)))
            next_block += len(blocks)
            requests[f"r{next_id}"] = RequestState(prompt, len(prompt), blocks,
                                                   rng.randrange(len(prompt)),
                                                   SamplingParams())
            tables.set(f"r{next_id}", blocks)
        scheduled = {}
        for request_id, state in requests.items():
            if rng.random() < 0.3:
                continue
            left = len(state.token_ids) - state.num_computed_tokens
            if left == 0:  # generated one: the token and maybe a block arrive
                state.token_ids.append(rng.randrange(1000))
                left = 1
                if len(state.token_ids) > len(state.block_ids) * BLOCK_SIZE:
                    state.block_ids.append(next_block)
                    tables.extend(request_id, [next_block])
                    next_block += 1
            scheduled[request_id] = rng.randrange(1, left + 1)
        if not scheduled:
            continue
        got = as_dict(build_batch(requests, scheduled, BLOCK_SIZE, torch.device("cpu"), tables))
        assert got == plain_batch(requests, scheduled) == per_request_batch(requests, scheduled)
        for request_id, n in scheduled.items():
            requests[request_id].num_computed_tokens += n
    # A step of decodes only (the vectorized fast path): one token each, the last known.
    for state in requests.values():
        state.num_computed_tokens = len(state.token_ids) - 1
    decodes = dict.fromkeys(requests, 1)
    got = as_dict(build_batch(requests, decodes, BLOCK_SIZE, torch.device("cpu"), tables))
    assert got == plain_batch(requests, decodes)
