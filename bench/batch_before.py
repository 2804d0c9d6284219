"""The step batch as the worker built it before persistent block tables: numpy per request,
each request's block list converted every step.

Kept as the baseline `bench/worker_ops.py` times `worker_svc.batch.build_batch` against, and
as a second reference `tests/worker_svc/test_batch_tables.py` checks `build_batch` with.
"""

from __future__ import annotations

import numpy as np

from worker_svc.batch import RequestState, batch_order


def padded(rows: list[list[int]]) -> list[list[int]]:
    """Block rows padded with block 0 to the longest."""
    width = max(map(len, rows))
    return [row + [0] * (width - len(row)) for row in rows]


def per_request_batch(
    requests: dict[str, RequestState], num_scheduled: dict[str, int], block_size: int
) -> dict:
    """The batch of one step (`num_scheduled` tokens per request id) as `as_dict` lays it out."""
    input_ids, positions, slots, seq_lens, starts, rows = [], [], [], [], [0], []
    sample_rows, sample_ids = [], []
    for request_id in batch_order(num_scheduled):
        state, n = requests[request_id], num_scheduled[request_id]
        start, end = state.num_computed_tokens, state.num_computed_tokens + n
        token_positions = np.arange(start, end)
        block_ids = np.asarray(state.block_ids, dtype=np.int64)
        input_ids.append(np.asarray(state.token_ids[start:end], dtype=np.int64))
        positions.append(token_positions)
        slots.append(
            block_ids[token_positions // block_size] * block_size + token_positions % block_size
        )
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        rows.append(state.block_ids[: -(-end // block_size)])
        if end == len(state.token_ids):
            sample_rows.append(starts[-1] - 1)
            sample_ids.append(request_id)
    return {
        "input_ids": np.concatenate(input_ids).tolist(),
        "positions": np.concatenate(positions).tolist(),
        "slots": np.concatenate(slots).tolist(),
        "seq_lens": seq_lens,
        "query_start_loc": starts,
        "block_tables": padded(rows),
        "sample_rows": sample_rows,
        "sample_request_ids": sample_ids,
    }


def as_dict(batch) -> dict:
    """A `build_batch` result as plain lists: what the constructions are compared in (and
    what each side of the benchmark ends in, so both pay the same conversions)."""
    m = batch.metadata
    return {
        "input_ids": batch.input_ids.tolist(),
        "positions": batch.positions.tolist(),
        "slots": m.slot_mapping.tolist(),
        "seq_lens": m.seq_lens.tolist(),
        "query_start_loc": m.query_start_loc.tolist(),
        "block_tables": m.block_tables.tolist(),
        "sample_rows": batch.sample_rows,
        "sample_request_ids": batch.sample_request_ids,
    }
