"""Random workloads against the scheduler core and a model of the workers' KV cache.

Prompts come from a 3-token alphabet, so prefixes repeat and the prefix cache hits; caches
are tiny, so preemption (recompute and swap) and eviction happen all the time. After every
schedule() and update() the invariants hold; the fake worker checks that every computed
position's KV is that of the request's own prefix. Every request ends exactly once, with
max_tokens tokens or at its first allowed EOS (or aborted), and in the end all is free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.step import RequestId
from scheduler_svc.core.scheduler import CapacityError, Scheduler, SchedulerConfig
from scheduler_svc.core.types import FinishReason, Request, RequestEvent
from tests.support.core_harness import (
    EOS,
    FakeWorker,
    assert_all_free,
    check_invariants,
    make_request,
    make_samples,
)

MAX_MODEL_LEN = 40
NUM_ARRIVAL_STEPS = 150
MAX_STEPS = 3000  # draining takes at most ~600 steps in practice


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    block_size = draw(st.sampled_from([1, 2, 4]))
    mode = draw(st.sampled_from(["recompute", "swap"]))
    return SchedulerConfig(
        num_blocks=draw(st.integers(24 // block_size, 64 // block_size)),
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(6, 24)),
        max_num_seqs=draw(st.integers(2, 8)),
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])),
        enable_prefix_caching=draw(st.sampled_from([True, True, True, False])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        preemption_mode=mode,
        num_swap_blocks=draw(st.integers(1, 12)) if mode == "swap" else 0,
    )


@dataclass
class Ledger:
    """What the test expects of each request, and what it got."""

    requests: dict[RequestId, Request] = field(default_factory=dict)
    tokens: dict[RequestId, list[int]] = field(default_factory=dict)
    finish: dict[RequestId, FinishReason] = field(default_factory=dict)

    def record(self, events: list[RequestEvent]) -> None:
        for event in events:
            assert event.request_id not in self.finish, f"{event.request_id} ended twice"
            self.tokens[event.request_id] += [t.token_id for t in event.new_tokens]
            if event.finish_reason is not None:
                self.finish[event.request_id] = event.finish_reason

    def check_outcomes(self) -> None:
        assert set(self.finish) == set(self.requests), "some request never finished"
        for request_id, reason in self.finish.items():
            request, tokens = self.requests[request_id], self.tokens[request_id]
            assert len(tokens) <= request.max_tokens
            first_stop = next(
                (i + 1 for i, t in enumerate(tokens) if t == EOS and i + 1 >= request.min_tokens),
                None,
            )
            if reason is FinishReason.LENGTH:
                assert len(tokens) == request.max_tokens and first_stop in (None, len(tokens))
            elif reason is FinishReason.STOP:
                assert first_stop == len(tokens)
            else:  # aborted before it could end by itself
                assert first_stop is None and len(tokens) < request.max_tokens


def arrivals(rng: random.Random, scheduler: Scheduler, ledger: Ledger, step_index: int) -> None:
    for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
        name = f"r{len(ledger.requests)}-{step_index}"
        prompt = [rng.choice([3, 4, 5]) for _ in range(rng.randint(1, 20))]
        kwargs = dict(
            max_tokens=rng.randint(1, 16),
            min_tokens=rng.choice([0, 0, 2]),
            priority=rng.randint(0, 2),
            arrival_time_s=step_index * 0.01,
        )
        n = rng.choice([1, 1, 1, 2, 3])
        if n > 1:
            group = make_samples(name, n, prompt, **kwargs)
        else:
            group = [make_request(name, prompt=prompt, **kwargs)]
        config = scheduler.config
        too_big = -(-(len(prompt) + kwargs["max_tokens"]) // config.block_size) > config.num_blocks
        too_long = len(prompt) + kwargs["max_tokens"] > config.max_model_len
        try:
            scheduler.add_samples(group)
        except CapacityError:
            assert too_big and not too_long
            continue
        except ValueError:
            assert too_long
            continue
        assert not too_big and not too_long
        for request in group:
            ledger.requests[request.request_id] = request
            ledger.tokens[request.request_id] = []


def random_abort(rng: random.Random, scheduler: Scheduler, ledger: Ledger) -> None:
    if scheduler.requests and rng.random() < 0.04:
        request_id = rng.choice(sorted(scheduler.requests))
        event = scheduler.abort(request_id)
        if event is not None:
            ledger.record([event])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), seed=st.integers(0, 2**32 - 1))
def test_random_workloads_keep_invariants_and_finish(config: SchedulerConfig, seed: int) -> None:
    rng = random.Random(seed)
    scheduler = Scheduler(config)
    worker = FakeWorker(scheduler)
    ledger = Ledger()

    def sample(request_id: str) -> int:
        return EOS if rng.random() < 0.08 else rng.choice([3, 4, 5, 6])

    for step_index in range(MAX_STEPS):
        # Arrivals and aborts stop after a while: what is left must finish by itself.
        arriving = step_index < NUM_ARRIVAL_STEPS
        if arriving:
            arrivals(rng, scheduler, ledger, step_index)
            random_abort(rng, scheduler, ledger)
        elif not scheduler.has_work():
            break
        output = scheduler.schedule()
        check_invariants(scheduler)
        if arriving:
            random_abort(rng, scheduler, ledger)  # in flight: waits for update()
        ledger.record(scheduler.update(output, worker.execute(output, sample)))
        check_invariants(scheduler)
    assert not scheduler.has_work() or scheduler.schedule().is_empty
    ledger.check_outcomes()
    assert_all_free(scheduler)
    assert not worker.tables or set(worker.tables) <= set(scheduler.requests)
