"""A rank's diagnostics without gRPC: memory figures, step statistics, a profiler trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import ModelRunnerOutput, SchedulerOutput
from tests.support.runner_script import GREEDY, ScriptedRequest, drive
from worker_svc import diagnostics
from worker_svc.diagnostics import Profiler, ProfilerPathError, ProfilerStateError, StepStats
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=3)
    return ModelRunner.from_config(
        RunnerConfig(model_path=str(folder), block_size=4, num_blocks=32, swap_space_bytes=1 << 20)
    )


def test_memory_adds_up(runner: ModelRunner) -> None:
    memory = diagnostics.memory_stats(runner)
    assert memory.device == "cpu"
    assert memory.weight_bytes == runner.info().weight_bytes > 0
    assert memory.num_allocated_kv_blocks == 32
    assert memory.kv_cache_bytes == 32 * memory.kv_bytes_per_block > 0
    assert memory.kv_cache_bytes == sum(t.nbytes for t in runner.kv_caches)
    assert memory.num_swap_blocks == runner.num_swap_blocks > 0
    assert memory.swap_bytes == memory.num_swap_blocks * memory.kv_bytes_per_block
    # The process holds at least the weights and the cache it allocated.
    assert memory.rss_bytes > memory.weight_bytes
    assert memory.device_total_bytes == 0  # CPU


def test_step_stats_window_and_totals() -> None:
    clock = FakeClock()
    stats = StepStats(clock)
    clock.now += 100
    for _ in range(10):  # ten steps of 0.5 s, 0.1 s of it communicating, one a second
        clock.now += 1
        stats.record(0.5, collective_s=0.05, pp_send_s=0.02, pp_recv_s=0.03)
    clock.now += 50  # idle
    totals = stats.snapshot(window_s=3600)
    assert totals.num_steps == 10
    assert totals.busy_s == pytest.approx(5.0)
    assert totals.collective_s == pytest.approx(0.5)
    assert totals.window_s == pytest.approx(160)  # no older than the accumulator
    assert totals.window_num_steps == 10
    assert totals.utilization == pytest.approx(5.0 / 160)
    assert totals.compute_fraction == pytest.approx(0.8)
    recent = stats.snapshot(window_s=30)  # only the idle time
    assert recent.window_num_steps == 0 and recent.utilization == 0.0
    assert recent.num_steps == 10  # the totals do not depend on the window
    clock.now -= 45  # 5 s after the last step: only the last steps are in a 8 s window
    last = stats.snapshot(window_s=8)
    assert 2 <= last.window_num_steps <= 4


def test_steps_are_recorded_and_traced(runner: ModelRunner, tmp_path: Path) -> None:
    stats = StepStats()
    profiler = Profiler(runner.device, stats, base_dir=tmp_path)
    with pytest.raises(ProfilerStateError):
        profiler.stop()
    for outside in ("../elsewhere", "/etc", str(tmp_path.parent)):  # never outside the base
        with pytest.raises(ProfilerPathError):
            profiler.start(outside, "rank0")
    assert not (tmp_path.parent / "elsewhere").exists()
    profiler.start(str(tmp_path / "traces"), "rank0")  # absolute inside the base: fine
    with pytest.raises(ProfilerStateError):
        profiler.start(str(tmp_path / "traces"), "again")
    try:
        drive(
            _Recorded(runner, stats),
            [ScriptedRequest("a", [1, 2, 3, 4, 5], join_step=0)],  # type: ignore[arg-type]
            3,
            GREEDY,
        )
    finally:
        runner.reset_requests()
    trace = profiler.stop()
    assert stats.num_steps >= 3 and stats.busy_s > 0
    assert stats.collective_s == 0.0  # a single rank has no collectives
    assert trace.num_steps == stats.num_steps and trace.duration_s > 0
    events = json.loads(Path(trace.path).read_text())["traceEvents"]
    assert Path(trace.path).parent == tmp_path / "traces"
    assert any("aten::" in str(e.get("name", "")) for e in events)


class _Recorded:
    """The runner as the worker's servicer drives it: each step through `run_step_recorded`."""

    def __init__(self, runner: ModelRunner, stats: StepStats) -> None:
        self.runner, self.stats, self.num_blocks = runner, stats, runner.num_blocks

    def execute_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return diagnostics.run_step_recorded(self.runner, step, self.stats)
