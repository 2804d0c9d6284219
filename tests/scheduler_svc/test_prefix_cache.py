"""Automatic prefix caching: hits, the num_tokens - 1 cap, confirmation, LRU eviction."""

from __future__ import annotations

import pytest

from protos.block_hash import BlockHash
from scheduler_svc.core import kv_cache_manager
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_harness import (
    assert_all_free,
    check_invariants,
    fake_step,
    make_request,
    run_to_completion,
    step,
)


def make_scheduler(num_blocks: int = 16, **kwargs: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, **kwargs)
    )


def num_hit_blocks(scheduler: Scheduler, prompt: list[int]) -> int:
    """Cached blocks a request with this prompt would start from (a throwaway probe)."""
    probe = make_request(f"probe-{id(prompt)}-{len(prompt)}", prompt=prompt)
    hits = scheduler.kv.get_computed_blocks(probe)
    scheduler.kv.forget(probe)
    return len(hits)


def finish(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 1) -> None:
    scheduler.add_request(make_request(request_id, prompt=prompt, max_tokens=max_tokens))
    run_to_completion(scheduler)


def test_hit_skips_cached_blocks_and_counts_tokens() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 110))  # 10 tokens: blocks [100..103], [104..107], partial
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=2))
    output, _ = step(scheduler)
    a_blocks = output.new_requests[0].block_ids
    run_to_completion(scheduler)
    assert scheduler.stats().num_cached_blocks == 2  # the partial third block is not cached

    scheduler.add_request(make_request("b", prompt=prompt[:9] + [99, 98]))
    output, _ = step(scheduler)
    new = output.new_requests[0]
    assert new.num_computed_tokens == 8 and new.block_ids[:2] == a_blocks[:2]
    assert output.num_scheduled_tokens == {"b": 3}
    stats = scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)


def test_hit_leaves_at_least_one_token_and_never_a_shared_block_to_write() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 108))  # two full blocks
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=3))
    step(scheduler)  # a's prompt is computed and both blocks are cached
    a_blocks = scheduler.requests["a"].block_ids[:2]

    # All 8 tokens are cached, but the last must be computed: only whole blocks within the
    # first num_tokens - 1 tokens count, so the second block is recomputed in a fresh one.
    scheduler.add_request(make_request("same", prompt=prompt))
    scheduler.add_request(make_request("longer", prompt=prompt + [5]))
    output, _ = step(scheduler)
    by_id = {n.request_id: n for n in output.new_requests}
    assert by_id["same"].num_computed_tokens == 4 and output.num_scheduled_tokens["same"] == 4
    assert by_id["same"].block_ids[0] == a_blocks[0] and by_id["same"].block_ids[1] != a_blocks[1]
    assert by_id["longer"].num_computed_tokens == 8 and output.num_scheduled_tokens["longer"] == 1
    assert by_id["longer"].block_ids[:2] == a_blocks
    assert scheduler.kv.pool.ref_count(a_blocks[0]) == 3
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_blocks_enter_the_cache_only_after_update() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 108))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=2))
    output = scheduler.schedule()  # a's 8 prompt tokens are scheduled, not computed yet
    assert scheduler.stats().num_cached_blocks == 0
    assert num_hit_blocks(scheduler, prompt + [1]) == 0
    scheduler.update(output, fake_step(scheduler, output))
    assert scheduler.stats().num_cached_blocks == 2
    assert num_hit_blocks(scheduler, prompt + [1]) == 2


def test_requests_computing_one_prefix_in_the_same_step_do_not_share() -> None:
    scheduler = make_scheduler()
    prompt = list(range(100, 109))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=2))
    scheduler.add_request(make_request("b", prompt=prompt, max_tokens=2))
    output, _ = step(scheduler)
    assert all(n.num_computed_tokens == 0 for n in output.new_requests)
    a_blocks, b_blocks = (scheduler.requests[r].block_ids[:2] for r in ("a", "b"))
    assert not set(a_blocks) & set(b_blocks)
    assert scheduler.stats().num_cached_blocks == 2  # b's copies of a's hashes stay private
    scheduler.add_request(make_request("c", prompt=prompt))
    output, _ = step(scheduler)
    assert output.new_requests[0].block_ids[:2] == a_blocks


def test_a_hit_is_confirmed_by_tokens_not_by_the_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every block hashes the same: only the stored tokens tell blocks apart.
    monkeypatch.setattr(
        kv_cache_manager,
        "hash_block_tokens",
        lambda parent, tokens, extra=b"": BlockHash(b"collision"),
    )
    scheduler = make_scheduler()
    finish(scheduler, "a", list(range(100, 109)))
    assert scheduler.stats().num_cached_blocks == 1
    scheduler.add_request(make_request("b", prompt=list(range(200, 209))))
    output, _ = step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 0
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_a_hit_is_confirmed_by_its_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    # A hash that forgets the parent: [1 2 3 4] at block 1 collides with block 0.
    monkeypatch.setattr(
        kv_cache_manager,
        "hash_block_tokens",
        lambda parent, tokens, extra=b"": BlockHash(bytes(tokens)),
    )
    scheduler = make_scheduler()
    finish(scheduler, "a", [1, 2, 3, 4, 1, 2, 3, 4, 5])
    scheduler.add_request(make_request("b", prompt=[1, 2, 3, 4, 1, 2, 3, 4, 6]))
    output, _ = step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 4  # block 0 only


def test_free_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    scheduler = make_scheduler(num_blocks=6)
    prompts = {
        name: list(range(start, start + 8)) for name, start in [("a", 100), ("b", 200), ("c", 300)]
    }
    for name, prompt in prompts.items():
        finish(scheduler, name, prompt)  # each leaves 2 cached free blocks
    pool = scheduler.kv.pool
    # Freed last block first, so a sequence's tail goes before its head.
    assert pool.free_block_ids() == [1, 0, 3, 2, 5, 4]
    assert pool.num_cached_blocks == 6 and pool.num_free_blocks == 6

    scheduler.add_request(make_request("d", prompt=list(range(400, 411)), max_tokens=1))
    output, _ = step(scheduler)
    assert output.new_requests[0].block_ids == [1, 0, 3]
    assert pool.num_evictions == 3
    run_to_completion(scheduler)
    # a is gone; b lost its tail; c is intact.
    hits = {name: num_hit_blocks(scheduler, p + [1]) for name, p in prompts.items()}
    assert hits == {"a": 0, "b": 1, "c": 2}


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_free_queue() -> None:
    scheduler = make_scheduler(num_blocks=6)
    finish(scheduler, "a", list(range(100, 108)))
    finish(scheduler, "b", list(range(200, 208)))
    pool = scheduler.kv.pool
    assert pool.free_block_ids() == [4, 5, 1, 0, 3, 2]
    scheduler.add_request(make_request("a2", prompt=list(range(100, 109)), max_tokens=1))
    output, _ = step(scheduler)
    assert output.new_requests[0].block_ids[:2] == [0, 1]
    assert scheduler.kv.pool.ref_count(0) == 0  # a2 finished in that step: back to free
    # Used again, a's blocks are now the most recently freed: b's go first. (a2's partial
    # third block was never cached: it went back to the fresh blocks.)
    assert pool.free_block_ids() == [5, 4, 3, 2, 1, 0]
    assert pool.num_cached_blocks == 4


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    # Each request grows to 3 blocks; 4 cannot hold both. The victim's tail block is evicted
    # first, so its head block is still cached when it comes back.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("old", prompt=list(range(100, 104)), max_tokens=6))
    scheduler.add_request(make_request("new", prompt=list(range(200, 204)), max_tokens=6))
    resumed = []
    for _ in range(40):
        if not scheduler.has_work():
            break
        output, _ = step(scheduler)
        resumed += [n for n in output.new_requests if n.num_prompt_tokens < len(n.token_ids)]
    assert scheduler.num_preemptions > 0 and resumed
    assert all(n.num_computed_tokens > 0 for n in resumed)
    assert_all_free(scheduler)


def test_prefix_caching_off_never_shares() -> None:
    scheduler = make_scheduler(enable_prefix_caching=False)
    finish(scheduler, "a", list(range(100, 109)))
    scheduler.add_request(make_request("b", prompt=list(range(100, 109))))
    output, _ = step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 0
    stats = scheduler.stats()
    assert stats.num_cached_blocks == 0 and stats.prefix_cache_queries == 0


def test_invalidate_prefix_cache_forgets_everything() -> None:
    scheduler = make_scheduler()
    finish(scheduler, "a", list(range(100, 109)))
    scheduler.invalidate_prefix_cache()
    assert scheduler.stats().num_cached_blocks == 0
    scheduler.add_request(make_request("b", prompt=list(range(100, 109))))
    output, _ = step(scheduler)
    assert output.new_requests[0].num_computed_tokens == 0


def test_reset_prefix_cache_drops_free_blocks_and_keeps_those_in_use() -> None:
    """The admin's reset while a request runs: the finished request's cached blocks are
    dropped (fresh again), the running one's stay its own and stay cached; it finishes as
    it would have, and a second reset once it is done drops the rest."""
    scheduler = make_scheduler()
    finish(scheduler, "done", list(range(100, 109)))  # two full cached blocks, now free
    running = make_request("running", prompt=list(range(200, 209)), max_tokens=6)
    scheduler.add_request(running)
    step(scheduler)  # its prompt is computed: its two full blocks are cached, in use
    assert num_hit_blocks(scheduler, list(range(100, 109))) == 2
    held = set(running.block_ids)
    assert scheduler.reset_prefix_cache() == 2
    check_invariants(scheduler)
    assert num_hit_blocks(scheduler, list(range(100, 109))) == 0
    assert scheduler.stats().num_cached_blocks == 2  # the running request's
    assert set(running.block_ids) == held
    # A prompt sharing the running request's prefix still shares its blocks.
    assert num_hit_blocks(scheduler, list(range(200, 209))) == 2
    outputs = run_to_completion(scheduler)
    assert outputs["running"] == [7] * 5  # after the one its first step sampled
    assert_all_free(scheduler)
    assert scheduler.reset_prefix_cache() == 3  # 9 prompt + 5 output tokens: 3 full blocks
    assert scheduler.stats().num_cached_blocks == 0
    assert scheduler.reset_prefix_cache() == 0
