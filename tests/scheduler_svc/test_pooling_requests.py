"""Embedding requests in the scheduler core: prefill only (chunked under the budget), ended
by the step that completes the prompt with its pooled vector, blocks freed at once;
prefix-cache hits only for last-token pooling; preempted ones recompute (their pooling state
is on the workers), even under swap; and the group's kind is enforced at admission."""

from __future__ import annotations

import pytest

from protos.step import ModelRunnerOutput, PoolingInfo, PoolingParams, SchedulerOutput
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.types import FinishReason
from tests.support.core_harness import check_invariants, make_request

LAST = PoolingInfo("embed", "last", True, 8)
MEAN = PoolingInfo("embed", "mean", False, 8)


def embed_request(request_id: str, prompt_len: int = 0, prompt: list[int] | None = None):
    return make_request(
        request_id, prompt_len, max_tokens=1, prompt=prompt, pooling=PoolingParams()
    )


def pooled_step(scheduler: Scheduler, output: SchedulerOutput) -> ModelRunnerOutput:
    """What the driver returns: a vector for each request whose prompt the step completes."""
    pooled = {
        r: r.encode()
        for r in output.num_scheduled_tokens
        if scheduler.requests[r].num_computed_tokens == scheduler.requests[r].num_tokens
    }
    return ModelRunnerOutput(output.step_id, pooled=pooled)


def run(scheduler: Scheduler, max_steps: int = 50) -> dict[str, tuple[bytes, list[int]]]:
    """Steps to the end: each request's vector and the chunk sizes it was computed in."""
    done: dict[str, tuple[bytes, list[int]]] = {}
    chunks: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        output = scheduler.schedule()
        check_invariants(scheduler)
        for request_id, count in output.num_scheduled_tokens.items():
            chunks.setdefault(request_id, []).append(count)
        for event in scheduler.update(output, pooled_step(scheduler, output)):
            assert event.finish_reason is FinishReason.STOP and not event.new_tokens
            done[event.request_id] = (event.embedding, chunks[event.request_id])
        check_invariants(scheduler)
    return done


def test_prompts_are_chunked_then_pooled_and_their_blocks_freed() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8, pooling=LAST
        )
    )
    scheduler.add_request(embed_request("a", 20))
    scheduler.add_request(embed_request("b", 3))
    done = run(scheduler)
    assert done == {"a": (b"a", [8, 8, 4]), "b": (b"b", [3])}
    assert scheduler.kv.pool.num_free_blocks == 16


def test_a_full_context_input_fits() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=16, pooling=LAST)
    )
    scheduler.add_request(embed_request("a", 16))  # prompt == max_model_len: no output token
    assert run(scheduler)["a"][0] == b"a"
    with pytest.raises(ValueError, match="input of 17 tokens exceeds max_model_len"):
        scheduler.add_request(embed_request("b", 17))


@pytest.mark.parametrize("pooling, expected_chunks", [(LAST, [1]), (MEAN, [9])])
def test_prefix_cache_hits_only_for_last_token_pooling(
    pooling: PoolingInfo, expected_chunks: list[int]
) -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64, pooling=pooling)
    )
    prompt = list(range(10, 19))
    scheduler.add_request(embed_request("first", prompt=prompt))
    run(scheduler)
    scheduler.add_request(embed_request("again", prompt=prompt))
    # Last-token pooling recomputes only what the cache lacks (the last, partial block);
    # mean pooling reads every row, so it recomputes all 9.
    assert run(scheduler)["again"][1] == expected_chunks


def test_preempted_embedding_requests_recompute_even_under_swap() -> None:
    # 4 tokens a step each: all three hold 2 blocks of the 6 when "a" needs its third.
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=6,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=4,
            pooling=MEAN,
            preemption_mode="swap",
            num_swap_blocks=16,
        )
    )
    for name in ("a", "b", "c"):
        scheduler.add_request(embed_request(name, 12))
    done = run(scheduler)
    assert set(done) == {"a", "b", "c"}
    assert scheduler.num_swap_outs == 0
    assert scheduler.num_preemptions >= 1
    for _, chunks in done.values():  # a recompute starts over: its chunks cover 12 again
        assert sum(chunks) >= 12


def test_the_group_kind_is_enforced_at_admission() -> None:
    embeds = Scheduler(SchedulerConfig(num_blocks=8, block_size=4, pooling=LAST))
    with pytest.raises(ValueError, match="embedding model: it does not generate text"):
        embeds.add_request(make_request("g", 4))
    generates = Scheduler(SchedulerConfig(num_blocks=8, block_size=4))
    with pytest.raises(ValueError, match="--task embed"):
        generates.add_request(embed_request("e", 4))


def test_a_vector_for_a_request_still_prefilling_is_refused() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=4, pooling=LAST
        )
    )
    scheduler.add_request(embed_request("a", 10))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="pooled before its prompt was computed"):
        scheduler.update(output, ModelRunnerOutput(output.step_id, pooled={"a": b"x"}))
