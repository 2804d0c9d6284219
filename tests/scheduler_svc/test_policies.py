"""Long-prefill chunks, priority admission and victims, swap preemption."""

from __future__ import annotations

import pytest

from protos.step import RequestId
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.core.types import FinishReason, RequestStatus
from tests.support.core_harness import (
    assert_all_free,
    make_request,
    run_to_completion,
    step,
)


def make_scheduler(num_blocks: int = 64, **kwargs: object) -> Scheduler:
    return Scheduler(
        SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=64, **kwargs)
    )


# ---- long prefill threshold -------------------------------------------------------------


def test_long_prefill_chunks_never_exceed_the_threshold_and_decodes_keep_flowing() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("decode", prompt=[1, 2], max_tokens=10))
    step(scheduler)
    scheduler.add_request(make_request("long", prompt=list(range(100, 130)), max_tokens=2))
    scheduler.add_request(make_request("long2", prompt=list(range(200, 220)), max_tokens=2))
    chunks = []
    for _ in range(4):
        output, _ = step(scheduler)
        assert output.num_scheduled_tokens["decode"] == 1
        scheduled = output.num_scheduled_tokens
        chunks.append((scheduled.get("long"), scheduled.get("long2")))
    assert chunks == [(8, 8), (8, 8), (8, 4), (6, 1)]  # (6, 1): long's last chunk; long2 decodes
    run_to_completion(scheduler)


def test_without_threshold_a_prompt_takes_the_whole_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(make_request("long", prompt=list(range(100, 130))))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 30}


def test_threshold_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="chunked"):
        SchedulerConfig(
            num_blocks=8,
            max_num_batched_tokens=4096,
            max_model_len=64,
            enable_chunked_prefill=False,
            long_prefill_token_threshold=8,
        )


# ---- priority ------------------------------------------------------------------------------


def admitted_order(scheduler: Scheduler) -> list[str]:
    order = []
    while scheduler.has_work():
        output, _ = step(scheduler)
        order += [n.request_id for n in output.new_requests if n.request_id not in order]
    return order


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("fcfs", ["low", "high", "high-late", "high-early"]),
        ("priority", ["high", "high-early", "high-late", "low"]),
    ],
)
def test_admission_order(policy: str, expected: list[str]) -> None:
    scheduler = make_scheduler(max_num_seqs=1, policy=policy)
    scheduler.add_request(make_request("low", prompt=[1, 2], max_tokens=1, priority=5))
    scheduler.add_request(
        make_request("high", prompt=[3, 4], max_tokens=1, priority=0, arrival_time_s=2.0)
    )
    scheduler.add_request(
        make_request("high-late", prompt=[5, 6], max_tokens=1, priority=0, arrival_time_s=3.0)
    )
    scheduler.add_request(
        make_request("high-early", prompt=[7, 8], max_tokens=1, priority=0, arrival_time_s=2.5)
    )
    assert admitted_order(scheduler) == expected


def grow_until_preemption(scheduler: Scheduler, counts: dict[str, int] | None = None) -> str:
    """Steps until a request is preempted, adding tokens to `counts`; returns the victim's id."""
    for _ in range(50):
        output, events = step(scheduler)
        for event in events:
            if counts is not None:
                counts[event.request_id] = counts.get(event.request_id, 0) + len(event.new_tokens)
        preempted = [
            r
            for r in scheduler.requests.values()
            if r.status in (RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
        ]
        if preempted:
            return preempted[0].request_id
    raise AssertionError("no preemption")


@pytest.mark.parametrize("policy, victim", [("fcfs", "new-important"), ("priority", "old-minor")])
def test_preemption_victim(policy: str, victim: str) -> None:
    # Two requests growing to 3 blocks each in a 4-block cache.
    scheduler = make_scheduler(num_blocks=4, policy=policy)
    scheduler.add_request(make_request("old-minor", prompt=[1, 2, 3, 4], max_tokens=8, priority=1))
    step(scheduler)
    scheduler.add_request(
        make_request("new-important", prompt=[5, 6, 7, 8], max_tokens=8, priority=0)
    )
    counts: dict[str, int] = {}
    assert grow_until_preemption(scheduler, counts) == victim
    for request_id, tokens in run_to_completion(scheduler).items():
        counts[request_id] = counts.get(request_id, 0) + len(tokens)
    assert counts == {"old-minor": 8 - 1, "new-important": 8}  # old-minor's first token: step 1
    assert_all_free(scheduler)


def test_running_list_follows_priority_so_important_requests_get_the_budget_first() -> None:
    scheduler = make_scheduler(policy="priority", max_num_batched_tokens=6)
    scheduler.add_request(make_request("minor", prompt=list(range(100, 120)), priority=3))
    step(scheduler)
    scheduler.add_request(make_request("major", prompt=list(range(200, 220)), priority=0))
    output, _ = step(scheduler)  # minor is running; major waits (budget spent)
    assert output.num_scheduled_tokens == {"minor": 6}
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"minor": 6}
    output, _ = step(scheduler)  # minor's last 2 tokens, then major
    assert output.num_scheduled_tokens == {"minor": 2, "major": 4}
    assert [r.request_id for r in scheduler.running] == ["major", "minor"]
    output, _ = step(scheduler)  # major first: minor's decode waits for budget
    assert output.num_scheduled_tokens == {"major": 6}


def test_preempted_request_goes_ahead_of_later_arrivals() -> None:
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", prompt=[1, 2, 3, 4], max_tokens=8))
    scheduler.add_request(make_request("b", prompt=[5, 6, 7, 8], max_tokens=8))
    assert grow_until_preemption(scheduler) == "b"
    scheduler.add_request(make_request("c", prompt=[9, 10], max_tokens=2))
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


# ---- swap preemption ---------------------------------------------------------------------------


def test_swap_out_then_in_keeps_the_computed_tokens() -> None:
    scheduler = make_scheduler(num_blocks=4, preemption_mode="swap", num_swap_blocks=8)
    scheduler.add_request(make_request("a", prompt=[1, 2, 3, 4], max_tokens=8))
    scheduler.add_request(make_request("b", prompt=[5, 6, 7, 8], max_tokens=8))
    swap_out = swap_in = None
    b_blocks_before: list[int] = []
    b_computed = 0
    num_tokens = {"a": 0, "b": 0}
    for _ in range(50):
        b = scheduler.requests.get(RequestId("b"))
        if b is not None and b.status is RequestStatus.RUNNING:
            b_blocks_before, b_computed = list(b.block_ids), b.num_computed_tokens
        output, events = step(scheduler)
        for event in events:
            num_tokens[event.request_id] += len(event.new_tokens)
        if output.blocks_to_swap_out:
            swap_out = output
            assert "b" in output.finished_request_ids  # the workers forget it this step
            assert scheduler.requests["b"].status is RequestStatus.SWAPPED
            assert scheduler.requests["b"].num_computed_tokens == b_computed
        if output.blocks_to_swap_in:
            swap_in = output
            break
    assert swap_out is not None and swap_in is not None
    assert [d for d, _ in swap_out.blocks_to_swap_out] == b_blocks_before
    swap_ids = [s for _, s in swap_out.blocks_to_swap_out]
    resumed = swap_in.new_requests[0]
    assert resumed.request_id == "b" and resumed.num_computed_tokens == b_computed
    assert swap_in.blocks_to_swap_in == list(zip(swap_ids, resumed.block_ids))
    assert resumed.token_ids == scheduler.requests["b"].all_token_ids[: len(resumed.token_ids)]
    assert swap_in.num_scheduled_tokens["b"] == 1  # just the next decode: nothing recomputed
    stats = scheduler.stats()  # the counters say so too (GetStats, /metrics)
    assert stats.num_swap_outs == stats.num_swap_ins == stats.num_preemptions == 1
    for request_id, tokens in run_to_completion(scheduler).items():
        num_tokens[request_id] += len(tokens)
    assert num_tokens == {"a": 8, "b": 8}
    assert_all_free(scheduler)


def test_swap_falls_back_to_recompute_when_swap_space_is_short() -> None:
    scheduler = make_scheduler(num_blocks=4, preemption_mode="swap", num_swap_blocks=1)
    scheduler.add_request(make_request("a", prompt=[1, 2, 3, 4], max_tokens=8))
    scheduler.add_request(make_request("b", prompt=[5, 6, 7, 8], max_tokens=8))
    counts: dict[str, int] = {}
    assert grow_until_preemption(scheduler, counts) == "b"
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.kv.swap.num_free_blocks == 1
    for request_id, tokens in run_to_completion(scheduler).items():
        counts[request_id] = counts.get(request_id, 0) + len(tokens)
    assert counts == {"a": 8, "b": 8}
    assert_all_free(scheduler)
    stats = scheduler.stats()
    assert stats.num_preemptions >= 1 and stats.num_swap_outs == stats.num_swap_ins == 0


def test_abort_of_a_swapped_request_frees_its_swap_blocks() -> None:
    scheduler = make_scheduler(num_blocks=4, preemption_mode="swap", num_swap_blocks=8)
    scheduler.add_request(make_request("a", prompt=[1, 2, 3, 4], max_tokens=8))
    scheduler.add_request(make_request("b", prompt=[5, 6, 7, 8], max_tokens=8))
    assert grow_until_preemption(scheduler) == "b"
    assert scheduler.kv.swap.num_free_blocks < 8
    event = scheduler.abort(RequestId("b"))
    assert event is not None and event.finish_reason is FinishReason.ABORT
    assert scheduler.kv.swap.num_free_blocks == 8
    run_to_completion(scheduler)
    assert_all_free(scheduler)


def test_swap_mode_needs_swap_space() -> None:
    with pytest.raises(ValueError, match="num_swap_blocks"):
        SchedulerConfig(num_blocks=8, preemption_mode="swap")
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(num_blocks=8, policy="lifo")
