"""The step batch gathered from persistent block tables (worker_svc/batch.py) equals the
plain per-request construction below, over random step histories: new requests, chunked
prefills, decodes, new blocks, finished requests, rows reused and tables grown; and equals
the per-request numpy construction it replaced (bench/batch_before.py)."""

from __future__ import annotations

import random

import torch

from bench.batch_before import as_dict, padded, per_request_batch
from protos.step import SamplingParams
from worker_svc.batch import BlockTables, RequestState, batch_order, build_batch

BLOCK_SIZE = 4


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
    return {
        "input_ids": input_ids,
        "positions": positions,
        "slots": slots,
        "seq_lens": seq_lens,
        "query_start_loc": starts,
        "block_tables": padded(rows),
        "sample_rows": sample_rows,
        "sample_request_ids": sample_ids,
    }


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
            requests[f"r{next_id}"] = RequestState(
                prompt, len(prompt), blocks, rng.randrange(len(prompt)), SamplingParams()
            )
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
        assert (
            got
            == plain_batch(requests, scheduled)
            == per_request_batch(requests, scheduled, BLOCK_SIZE)
        )
        for request_id, n in scheduled.items():
            requests[request_id].num_computed_tokens += n
    # A step of decodes only (the vectorized fast path): one token each, the last known.
    for state in requests.values():
        state.num_computed_tokens = len(state.token_ids) - 1
    decodes = dict.fromkeys(requests, 1)
    got = as_dict(build_batch(requests, decodes, BLOCK_SIZE, torch.device("cpu"), tables))
    assert got == plain_batch(requests, decodes)
