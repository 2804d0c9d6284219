"""n > 1: forks share their leader's computed prompt and copy its last prompt block."""

from __future__ import annotations

import pytest

from protos.step import RequestId
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.types import FinishReason
from tests.support.core_harness import (
    assert_all_free,
    fake_step,
    make_request,
    make_samples,
    run_to_completion,
    step,
)


def make_scheduler(num_blocks: int = 32, **kwargs: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, **kwargs)
    )


@pytest.mark.parametrize("prompt_len, num_shared", [(10, 2), (8, 1), (3, 0)])
def test_forks_start_after_the_leader_samples_and_copy_the_last_prompt_block(
    prompt_len: int, num_shared: int
) -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 3, prompt=list(range(100, 100 + prompt_len))))
    output, _ = step(scheduler)
    assert list(output.num_scheduled_tokens) == ["g"]  # forks wait for the leader's prompt
    assert not output.blocks_to_copy
    leader_blocks = list(scheduler.requests["g"].block_ids)
    last = leader_blocks[(prompt_len - 1) // 4]  # the block of the last prompt token

    output, events = step(scheduler, {"g#1": 41, "g#2": 42})
    assert output.num_scheduled_tokens == {"g": 1, "g#1": 1, "g#2": 1}
    forks = {n.request_id: n for n in output.new_requests}
    assert set(forks) == {"g#1", "g#2"}
    copies = []
    for fork in forks.values():
        assert fork.num_computed_tokens == prompt_len - 1
        assert fork.token_ids == list(range(100, 100 + prompt_len))
        assert fork.block_ids[:num_shared] == leader_blocks[:num_shared]
        assert len(fork.block_ids) == num_shared + 1
        copies.append((last, fork.block_ids[-1]))
    assert output.blocks_to_copy == copies
    assert len({dst for _, dst in copies} | set(leader_blocks)) == len(leader_blocks) + 2
    for block_id in leader_blocks[:num_shared]:
        assert scheduler.kv.pool.ref_count(block_id) == 3
    sampled = {e.request_id: e.new_tokens[0].token_id for e in events}
    assert sampled == {"g": 7, "g#1": 41, "g#2": 42}
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_every_sample_gets_max_tokens() -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 4, prompt=list(range(100, 109)), max_tokens=6))
    outputs = run_to_completion(scheduler)
    assert {k: len(v) for k, v in outputs.items()} == {"g": 6, "g#1": 6, "g#2": 6, "g#3": 6}
    assert_all_free(scheduler)


def test_aborting_a_waiting_fork() -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 3, prompt=list(range(100, 109))))
    output = scheduler.schedule()
    event = scheduler.abort(RequestId("g#1"))  # not in flight: ends at once
    assert event is not None and event.finish_reason is FinishReason.ABORT
    scheduler.update(output, fake_step(scheduler, output))
    outputs = run_to_completion(scheduler)
    assert set(outputs) == {"g", "g#2"}
    assert_all_free(scheduler)


def test_leader_aborted_before_forks_start_falls_back_to_the_prefix_cache() -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 3, prompt=list(range(100, 110))))
    output = scheduler.schedule()
    assert scheduler.abort(RequestId("g")) is None  # in flight: ends at update
    events = scheduler.update(output, fake_step(scheduler, output))
    assert events[-1].request_id == "g" and events[-1].finish_reason is FinishReason.ABORT
    output, _ = step(scheduler)
    assert not output.blocks_to_copy
    # Admitted as ordinary requests: the leader's two full prompt blocks were cached.
    assert [n.num_computed_tokens for n in output.new_requests] == [8, 8]
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_leader_aborted_after_forks_started() -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 3, prompt=list(range(100, 110)), max_tokens=6))
    step(scheduler)
    step(scheduler)  # forks started, sharing the leader's blocks
    shared = scheduler.requests["g"].block_ids[0]
    assert scheduler.kv.pool.ref_count(shared) == 3
    scheduler.abort(RequestId("g"))
    assert scheduler.kv.pool.ref_count(shared) == 2
    outputs = run_to_completion(scheduler)
    assert {k: len(v) for k, v in outputs.items()} == {"g#1": 5, "g#2": 5}
    assert_all_free(scheduler)


def test_leader_finishing_in_its_first_step_lets_forks_use_the_cache() -> None:
    scheduler = make_scheduler()
    scheduler.add_samples(make_samples("g", 2, prompt=list(range(100, 110)), max_tokens=1))
    outputs = run_to_completion(scheduler)
    assert {k: len(v) for k, v in outputs.items()} == {"g": 1, "g#1": 1}
    assert scheduler.stats().prefix_cache_hits == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempting_groups_keeps_invariants_and_finishes(mode: str) -> None:
    # 12 blocks for 3 groups of 3 samples growing to 4 blocks each: constant preemption.
    scheduler = make_scheduler(
        num_blocks=12, preemption_mode=mode, num_swap_blocks=6 if mode == "swap" else 0
    )
    for g in range(3):
        scheduler.add_samples(make_samples(f"g{g}", 3, prompt=[g, 1, 2, 3, 4, 5], max_tokens=9))
    outputs = run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    assert sorted(len(v) for v in outputs.values()) == [9] * 9
    assert_all_free(scheduler)


def test_malformed_samples_are_rejected_whole() -> None:
    scheduler = make_scheduler()
    leader = make_request("g", prompt=[1, 2, 3])
    with pytest.raises(ValueError, match="prompt"):
        scheduler.add_samples([leader, make_request("f", prompt=[1, 2], fork_of=RequestId("g"))])
    with pytest.raises(ValueError, match="fork from"):
        scheduler.add_samples([leader, make_request("f", prompt=[1, 2, 3])])
    with pytest.raises(ValueError, match="add_samples"):
        scheduler.add_request(make_request("f", prompt=[1, 2, 3], fork_of=RequestId("g")))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_samples([])
    assert not scheduler.requests and not scheduler.has_work()
    scheduler.add_samples([leader])  # n = 1 is an ordinary request
    assert run_to_completion(scheduler) == {"g": [7, 7, 7, 7]}
