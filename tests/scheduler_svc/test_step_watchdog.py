"""The step watchdog: a step is suspect after a bound taken from recent step times; a suspect
step whose members all answer goes on (slow, not hung), one with a silent member fails at
once instead of at the step timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from protos.step import ModelRunnerOutput, RequestId, SampledToken, SamplingParams, SchedulerOutput
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.types import Request, RequestEvent
from scheduler_svc.engine_loop import EngineLoop
from scheduler_svc.step_watchdog import StepWatchdog, WatchdogConfig


def test_a_step_is_suspect_after_factor_times_the_recent_p99_within_the_bounds() -> None:
    watchdog = StepWatchdog(WatchdogConfig(factor=10, min_s=1.0, max_s=6.0, window=100))
    assert watchdog.suspect_after_s() == 6.0  # no history yet: the most patient bound
    for _ in range(99):
        watchdog.observe(0.02)
    watchdog.observe(0.3)  # one slow step in 100 is the p99
    assert watchdog.p99_s() == pytest.approx(0.02)
    assert watchdog.suspect_after_s() == 1.0  # 10 x 0.02 s, raised to min_s
    for _ in range(10):
        watchdog.observe(0.45)
    assert watchdog.suspect_after_s() == pytest.approx(4.5)
    for _ in range(100):
        watchdog.observe(2.0)  # a slow model: capped, a hang is still noticed in time
    assert watchdog.suspect_after_s() == 6.0
    assert watchdog.config.bound_s == 8.0
    with pytest.raises(ValueError):
        WatchdogConfig(min_s=5.0, max_s=1.0)


class ScriptedExecutor:
    """Answers every step with token 7 for each scheduled request; the step numbered
    `slow_step` takes `slow_s` (None: never returns). `silent` is what a probe finds."""

    def __init__(self, slow_step: int, slow_s: float | None, silent: list[str]) -> None:
        self.slow_step = slow_step
        self.slow_s = slow_s
        self.silent = silent
        self.num_probes = 0

    async def execute(
        self, output: SchedulerOutput, traceparents: dict[str, str]
    ) -> ModelRunnerOutput:
        if output.step_id == self.slow_step:
            if self.slow_s is None:
                await asyncio.Event().wait()  # hung
            await asyncio.sleep(self.slow_s)
        sampled = {r: SampledToken(7) for r in output.num_scheduled_tokens}
        return ModelRunnerOutput(output.step_id, sampled)

    async def unresponsive(self, timeout_s: float) -> list[str]:
        self.num_probes += 1
        return list(self.silent)

    async def close(self) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.failure: str | None = None
        self.done = asyncio.Event()

    def deliver(self, events: list[RequestEvent]) -> None:
        for event in events:
            self.tokens += [t.token_id for t in event.new_tokens]
            if event.finish_reason is not None:
                self.done.set()

    def fail(self, request_id: RequestId, message: str) -> None:
        self.failure = message
        self.done.set()


def run_one(executor: ScriptedExecutor) -> tuple[Sink, EngineLoop, float]:
    scheduler = Scheduler(
        SchedulerConfig(num_blocks=32, block_size=4, max_model_len=64, async_scheduling=False)
    )
    loop = EngineLoop(
        scheduler,
        executor,  # type: ignore[arg-type]
        watchdog=WatchdogConfig(min_s=0.1, max_s=0.1, probe_timeout_s=0.1, probe_interval_s=0.1),
    )
    sink = Sink()

    async def scenario() -> float:
        loop.submit([Request(RequestId("r"), [3, 4, 5], SamplingParams(temperature=0.0), 8)], sink)
        task = asyncio.create_task(loop.run())
        started = time.monotonic()
        await asyncio.wait_for(sink.done.wait(), 30)
        task.cancel()
        return time.monotonic() - started

    return sink, loop, asyncio.run(scenario())


def test_a_slow_step_whose_members_answer_goes_on() -> None:
    """A long but healthy step (a big prefill): probed, never failed."""
    executor = ScriptedExecutor(slow_step=3, slow_s=0.8, silent=[])
    sink, loop, _ = run_one(executor)
    assert sink.failure is None and sink.tokens == [7] * 8
    assert loop.watchdog.num_slow_steps == 1 and executor.num_probes >= 3


def test_a_step_with_a_silent_member_fails_at_once() -> None:
    """A frozen or cut-off worker: the step is given up after the bound, not the step
    timeout; without a group to re-form (in-process), its requests fail over."""
    executor = ScriptedExecutor(slow_step=3, slow_s=None, silent=["worker w1 (10.0.0.2:1)"])
    sink, loop, elapsed_s = run_one(executor)
    assert sink.failure is not None and "worker w1 (10.0.0.2:1) did not answer" in sink.failure
    assert elapsed_s < 5.0
    assert executor.num_probes == 1
