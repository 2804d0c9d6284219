"""KV that moves between groups, the core's side: holds (a prefill group's hand-off after
the first token, a drain's of a running request), imports (pulled KV admitted with its
prefix-cache hits), the fallbacks, and the count of recomputed tokens."""

from __future__ import annotations

from scheduler_svc.core.kv_moves import num_usable_tokens
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_harness import (
    assert_all_free,
    check_invariants,
    fake_step,
    make_request,
    run_to_completion,
    step,
)


def make_scheduler(num_blocks: int = 32, **kwargs: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=128, **kwargs)
    )


def test_prefill_hands_off_after_the_first_token_and_holds_the_prompt_kv() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt=list(range(100, 110)), max_tokens=1)
    request.hand_off_below = 20  # its own max_tokens: a prefill group cut it to 1
    scheduler.add_request(request)
    output, events = step(scheduler, {"a": 7})
    (event,) = events
    assert event.finish_reason is None and event.ends_stream
    assert [t.token_id for t in event.new_tokens] == [7]
    held = event.handoff
    assert held is not None and held.token_ids == tuple(range(100, 110))  # not the new token
    assert held.block_ids == tuple(output.new_requests[0].block_ids)  # 3 blocks, last partial
    assert "a" not in scheduler.requests and scheduler.held["a"] is held
    assert scheduler.kv.pool.num_used_blocks == 3
    # The two full prompt blocks are cached: prefix caching on the prefill side.
    assert scheduler.stats().num_cached_blocks == 2
    assert scheduler.release_held("a") and not scheduler.release_held("a")
    assert_all_free(scheduler)


def test_a_request_that_ends_by_its_own_length_is_not_handed_off() -> None:
    scheduler = make_scheduler()
    request = make_request("a", prompt_len=6, max_tokens=1)
    request.hand_off_below = 1  # max_tokens 1 asked: the prefill is the whole request
    scheduler.add_request(request)
    _, (event,) = step(scheduler, {"a": 7})
    assert event.finish_reason is not None and event.handoff is None and not scheduler.held


def test_drain_hands_off_a_running_request_but_not_one_in_flight() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=9, max_tokens=50))
    step(scheduler, {"a": 41})
    step(scheduler, {"a": 42})
    output = scheduler.schedule()  # a step in flight holds it
    assert scheduler.hand_off("a") is None
    scheduler.update(output, fake_step(scheduler, output, {"a": 43}))
    held = scheduler.hand_off("a")
    assert held is not None
    # Prompt + the first two outputs are computed; the third is sampled, not yet fed.
    assert held.token_ids == tuple(range(10, 19)) + (41, 42)
    assert len(held.block_ids) == 3 and "a" not in scheduler.requests
    check_invariants(scheduler)
    assert scheduler.hand_off("a") is None and scheduler.hand_off("unknown") is None
    scheduler.release_held("a")
    assert_all_free(scheduler)


def test_import_takes_prefix_hits_and_fresh_blocks_then_computes_only_the_last_token() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 111))  # 11 tokens
    run_to_completion_of(scheduler, make_request("warm", prompt=prompt[:8], max_tokens=1))
    # Resumed with 2 outputs, its KV held elsewhere for prompt + the first output.
    request = make_request("b", prompt=prompt, max_tokens=10)
    request.output_token_ids = [5, 6]
    imported = scheduler.add_importing(request, num_held_tokens=12)
    assert imported is not None
    assert imported.num_tokens == 12 and imported.first_index == 2  # 2 blocks were cached
    assert len(imported.block_ids) == 1  # tokens 8..11
    check_invariants(scheduler)
    assert scheduler.schedule().is_empty  # it waits for its pull
    assert scheduler.finish_import("b", pulled=True)
    output, _ = step(scheduler, {"b": 7})
    (new,) = output.new_requests
    assert new.num_computed_tokens == 12 and output.num_scheduled_tokens == {"b": 1}
    assert scheduler.stats().num_recomputed_tokens == 0
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_a_failed_pull_recomputes_and_counts_it() -> None:
    scheduler = make_scheduler()
    request = make_request("b", prompt_len=10, max_tokens=10)
    request.output_token_ids = [5]
    assert scheduler.add_importing(request, num_held_tokens=10) is not None
    assert scheduler.finish_import("b", pulled=False)
    check_invariants(scheduler)
    output, _ = step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 0
    assert output.num_scheduled_tokens == {"b": 11}
    assert scheduler.stats().num_recomputed_tokens == 10  # all but the last token
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_abort_while_importing_frees_its_blocks_and_the_pull_result_is_ignored() -> None:
    scheduler = make_scheduler()
    request = make_request("b", prompt_len=10, max_tokens=10)
    request.output_token_ids = [5]
    assert scheduler.add_importing(request, num_held_tokens=10) is not None
    assert scheduler.abort("b") is not None
    assert not scheduler.finish_import("b", pulled=True)
    assert_all_free(scheduler)


def test_nothing_to_pull_or_no_room_queues_it_to_recompute() -> None:
    scheduler = make_scheduler(num_blocks=10)
    scheduler.add_request(make_request("a", prompt_len=12, max_tokens=4))
    step(scheduler, {"a": 41})  # it holds 4 blocks
    request = make_request("b", prompt=list(range(200, 230)), max_tokens=2)
    request.output_token_ids = [5]
    assert scheduler.add_importing(request, num_held_tokens=30) is None  # 8 blocks: no room
    assert "b" in scheduler.waiting
    other = make_request("c", prompt_len=3, max_tokens=2)
    assert scheduler.add_importing(other, num_held_tokens=0) is None
    check_invariants(scheduler)


def test_usable_tokens_are_the_common_run_short_of_the_last_token() -> None:
    assert num_usable_tokens([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 3
    assert num_usable_tokens([1, 2, 3, 4], [1, 9, 3]) == 1
    assert num_usable_tokens([1, 2, 3, 4], []) == 0


def run_to_completion_of(scheduler: Scheduler, request: object) -> None:
    scheduler.add_request(request)  # type: ignore[arg-type]
    run_to_completion(scheduler)
