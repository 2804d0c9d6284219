"""Drafts on the sampling rank (worker_svc/spec_verify.py, worker_svc/batch.py): the rows a
drafted request feeds the LM head, what each row's draw sees, and which tokens are kept."""

from __future__ import annotations

import pytest
import torch

from protos.step import CachedRequestData, SampledToken, SamplingParams, SchedulerOutput
from worker_svc.batch import BlockTables, RequestState, build_batch, validate_step
from worker_svc.spec_verify import accept_drafts, check_drafts, sampling_rows


def state(tokens: list[int], drafts: list[int], computed: int, grammar: str = "") -> RequestState:
    return RequestState(
        token_ids=tokens,
        num_prompt_tokens=3,
        block_ids=[0, 1],
        num_computed_tokens=computed,
        sampling=SamplingParams(temperature=0.0, grammar=grammar),
        draft_token_ids=drafts,
    )


def test_a_drafted_request_samples_at_each_drafted_position() -> None:
    requests = {"a": state([1, 2, 3, 4], [5, 6], 3), "b": state([7, 8, 9, 10], [], 3)}
    tables = BlockTables()
    for request_id, s in requests.items():
        tables.set(request_id, s.block_ids)
    batch = build_batch(requests, {"a": 3, "b": 1}, 4, torch.device("cpu"), tables)
    assert batch.input_ids.tolist() == [4, 5, 6, 10]
    assert batch.positions.tolist() == [3, 4, 5, 3]
    assert batch.sample_rows == [0, 1, 2, 3]
    assert batch.sample_request_ids == ["a", "a", "a", "b"]
    rows = sampling_rows(requests, batch.sample_request_ids)
    assert [list(r.token_ids) for r in rows] == [
        [1, 2, 3, 4],
        [1, 2, 3, 4, 5],
        [1, 2, 3, 4, 5, 6],
        [7, 8, 9, 10],
    ]
    assert [r.num_output_tokens for r in rows] == [1, 2, 3, 1]  # each draw's seeded counter


@pytest.mark.parametrize(
    "drawn, kept", [([5, 6, 11], [5, 6, 11]), ([5, 9, 11], [5, 9]), ([8, 6, 11], [8])]
)
def test_drafts_are_kept_while_they_equal_the_draws(drawn: list[int], kept: list[int]) -> None:
    requests = {"a": state([1, 2, 3, 4], [5, 6], 3), "b": state([7, 8, 9, 10], [], 3)}
    tokens = [SampledToken(t) for t in [*drawn, 12]]
    sampled, spec = accept_drafts(requests, ["a", "a", "a", "b"], tokens)
    assert [sampled["a"].token_id] + [t.token_id for t in spec["a"]] == kept
    assert sampled["b"].token_id == 12 and "b" not in spec


def test_drafts_that_cannot_be_verified_exactly_are_refused() -> None:
    # A constrained request's drafts are verified under its grammar (test_structured.py).
    requests = {"a": state([1, 2, 3, 4], [], 3, grammar='{"json_schema": {}}')}
    step = SchedulerOutput(
        1, cached_requests=[CachedRequestData("a", [], 3, [], [5])], num_scheduled_tokens={"a": 2}
    )
    check_drafts(step, requests)
    plain = {"a": state([1, 2, 3, 4], [], 3)}
    step.append_sampled_tokens = True
    with pytest.raises(ValueError, match="async scheduling"):
        check_drafts(step, plain)
    # Drafts must be scheduled to their end, and be tokens of the vocabulary.
    short = SchedulerOutput(
        1,
        cached_requests=[CachedRequestData("a", [], 3, [], [5, 6])],
        num_scheduled_tokens={"a": 2},
    )
    with pytest.raises(ValueError, match="scheduled to their end"):
        validate_step(short, plain, num_blocks=4, block_size=4, max_model_len=64, vocab_size=100)
    outside = SchedulerOutput(
        1, cached_requests=[CachedRequestData("a", [], 3, [], [500])], num_scheduled_tokens={"a": 2}
    )
    with pytest.raises(ValueError, match="draft token id"):
        validate_step(outside, plain, num_blocks=4, block_size=4, max_model_len=64, vocab_size=100)
