"""Several steps in flight at once (pipeline parallelism): a request is in at most one of
them, preemption never touches a request whose step is still computing, and updates come
back in step order."""

from __future__ import annotations

from collections import deque

from protos.step import ModelRunnerOutput, RequestId, SampledToken
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from tests.support.core_harness import check_invariants, make_request


def sample_all(output, scheduler: Scheduler) -> ModelRunnerOutput:
    """Samples every request whose scheduled tokens reach the end of its known tokens.

    Computed before later steps are scheduled, as the worker would."""
    sampled = {}
    for request_id, _ in output.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        if request.num_computed_tokens == request.num_tokens:
            sampled[request_id] = SampledToken(7)
    return ModelRunnerOutput(output.step_id, sampled)


def run_pipelined(scheduler: Scheduler, depth: int, max_steps: int = 2000) -> dict[str, int]:
    in_flight: deque = deque()
    produced: dict[str, int] = {}
    for _ in range(max_steps):
        while len(in_flight) < depth and scheduler.has_work():
            output = scheduler.schedule()
            if output.is_empty:
                break
            ids = [set(o.num_scheduled_tokens) for o, _ in in_flight]
            for other in ids:
                assert not other & set(output.num_scheduled_tokens), "a request in two steps"
            in_flight.append((output, sample_all(output, scheduler)))
        if not in_flight:
            if not scheduler.has_work():
                return produced
            continue
        output, result = in_flight.popleft()
        for event in scheduler.update(output, result):
            produced[event.request_id] = produced.get(event.request_id, 0) + len(event.new_tokens)
        check_invariants(scheduler)
    raise AssertionError("did not finish")


def test_two_steps_in_flight_finish_every_request() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=16)
    )
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", prompt_len=3 + i, max_tokens=5 + i % 3))
    produced = run_pipelined(scheduler, depth=2)
    assert produced == {f"r{i}": 5 + i % 3 for i in range(8)}
    assert scheduler.kv.pool.num_free_blocks == 64


def test_preemption_with_steps_in_flight_spares_the_computing_requests() -> None:
    # 10 blocks of 4 tokens for 6 requests that grow to 16 tokens each: preemption is certain.
    for mode in ("recompute", "swap"):
        scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=10,
                block_size=4,
                max_model_len=64,
                preemption_mode=mode,
                num_swap_blocks=64 if mode == "swap" else 0,
                enable_prefix_caching=False,
            )
        )
        for i in range(6):
            scheduler.add_request(make_request(f"r{i}", prompt_len=4, max_tokens=12))
        produced = run_pipelined(scheduler, depth=3)
        assert produced == {f"r{i}": 12 for i in range(6)}, mode
        assert scheduler.num_preemptions > 0


def test_abort_of_a_request_in_flight_waits_for_its_step() -> None:
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64))
    scheduler.add_request(make_request("a", prompt_len=5, max_tokens=8))
    first = scheduler.schedule()
    result = sample_all(first, scheduler)
    scheduler.add_request(make_request("b", prompt_len=3, max_tokens=8))
    second = scheduler.schedule()  # only "b": "a" is still computing
    assert set(second.num_scheduled_tokens) == {"b"}
    assert scheduler.abort(RequestId("a")) is None
    events = scheduler.update(first, result)
    assert any(e.request_id == "a" and e.finish_reason is not None for e in events)
    scheduler.update(second, sample_all(second, scheduler))
    assert "a" not in scheduler.requests


def test_running_requests_split_into_microbatches() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64, num_microbatches=2)
    )
    for i in range(8):
        scheduler.add_request(make_request(f"r{i}", prompt_len=3, max_tokens=6))
    first = scheduler.schedule()  # admits all eight (prefills)
    scheduler.update(first, sample_all(first, scheduler))
    a = scheduler.schedule()
    b = scheduler.schedule()  # scheduled while `a` is in flight
    assert len(a.num_scheduled_tokens) == 4 and len(b.num_scheduled_tokens) == 4
    assert not set(a.num_scheduled_tokens) & set(b.num_scheduled_tokens)
    for output in (a, b):
        scheduler.update(output, sample_all(output, scheduler))
    run_pipelined(scheduler, depth=2)
    assert not scheduler.requests  # every request finished


def test_async_scheduling_plans_ahead_of_decodes_but_not_of_the_prefill() -> None:
    """A step queued behind a prefill would delay the first token its client waits for; a
    decode in flight is scheduled again at once, assuming its one sampled token."""
    scheduler = Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=4,
            max_model_len=64,
            max_num_batched_tokens=16,
            async_scheduling=True,
        )
    )
    scheduler.add_request(make_request("r", prompt_len=6, max_tokens=8))
    prefill = scheduler.schedule()
    assert prefill.num_scheduled_tokens == {"r": 6}
    assert scheduler.schedule().is_empty  # not ahead of its prefill
    scheduler.update(prefill, sample_all(prefill, scheduler))
    decode = scheduler.schedule()
    assert decode.num_scheduled_tokens == {"r": 1}
    ahead = scheduler.schedule()  # ahead of the decode in flight
    assert ahead.num_scheduled_tokens == {"r": 1}
    scheduler.update(decode, sample_all(decode, scheduler))
    check_invariants(scheduler)


def test_an_abort_under_async_scheduling_lands_when_the_step_in_flight_returns() -> None:
    """With a decode always planned ahead, a request is never out of flight: an abort that
    waited for that (the one an HTTP client's disconnect sends) waited for the request to
    finish, its blocks held. A request whose abort is pending is not scheduled again."""
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=4, max_model_len=256, async_scheduling=True)
    )
    scheduler.add_request(make_request("r", prompt_len=5, max_tokens=200))
    in_flight: deque = deque()
    num_updates_after_abort = 0
    for step in range(20):
        while len(in_flight) < 2 and not (output := scheduler.schedule()).is_empty:
            sampled = {r: SampledToken(7) for r in output.num_scheduled_tokens}  # decodes
            in_flight.append((output, ModelRunnerOutput(output.step_id, sampled)))
        if step == 4:
            assert len(in_flight) == 2, "a decode is planned ahead of the one in flight"
            assert scheduler.abort(RequestId("r")) is None  # it waits for its steps
        if "r" not in scheduler.requests:
            break
        output, result = in_flight.popleft()
        scheduler.update(output, result)
        num_updates_after_abort += step >= 4
    assert num_updates_after_abort == 2  # the two steps in flight, not one more
    assert "r" not in scheduler.requests and scheduler.stats().num_free_blocks == 64
    check_invariants(scheduler)
