"""The offline `LLM`'s admin and diagnostics: what `pagemesh.v1.Admin` answers for a mesh
group (GetMemory, GetStepStats, Start/StopProfile), for the ranks of this engine.

Each rank keeps a `RankDiagnostics` next to its model runner: it runs every step through
`worker_svc.diagnostics.run_step_recorded` and owns that rank's `Profiler`. One rank lives
in this process (its steps on `DiagnosedInprocExecutor`'s model thread); more ranks live
in local worker processes (offline/local_workers.py), which answer the same calls
(`RankDiagnostics.answer`) inside their step loops. Either way a call that touches the
profiler runs on the thread that runs the steps, as torch.profiler requires.

The KV blocks in use are the scheduler's fact, not a rank's: `LLM.get_memory` adds them to
every rank's report, as scheduler_svc/convert/admin.py's `group_memory_to_pb` does for the mesh.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from protos.step import LoraRef
from scheduler_svc.executor import InprocExecutor
from worker_svc.diagnostics import (
    Profiler,
    ProfileTraceFile,
    RankMemory,
    StepStats,
    StepStatsSnapshot,
    memory_stats,
    run_step_recorded,
)

if TYPE_CHECKING:
    from protos.step import ModelRunnerOutput, SchedulerOutput
    from scheduler_svc.core.config import SchedulerStats
    from worker_svc.runner import ModelRunner

TRACE_NAME = "pagemesh"


@dataclass(frozen=True)
class RankMemoryUsage:
    """One rank's memory (`memory`, bytes unless named in blocks, as the rank reports it)
    with the engine's KV block occupancy now, as the mesh's Admin.GetMemory reports it.

    `num_used_kv_blocks + num_free_kv_blocks == num_kv_blocks`: the scheduler's usable
    blocks (the smallest rank's allocation), the same block ids on every rank."""

    rank: int  # pp_rank * tensor_parallel_size + tp_rank
    tp_rank: int
    pp_rank: int
    memory: RankMemory
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_used_bytes: int  # num_used_kv_blocks x memory.kv_bytes_per_block
    num_used_swap_blocks: int  # of memory.num_swap_blocks


@dataclass(frozen=True)
class RankStepStats:
    """One rank's step figures (`stats`: seconds and steps, cumulative and over a window;
    `stats.utilization` is the window's busy fraction, 0..1)."""

    rank: int
    tp_rank: int
    pp_rank: int
    stats: StepStatsSnapshot


def memory_usage(
    rank: int,
    tp_rank: int,
    pp_rank: int,
    memory: RankMemory,
    stats: SchedulerStats,
    num_swap_blocks: int,
) -> RankMemoryUsage:
    """A rank's report with the scheduler's occupancy (`num_swap_blocks`: the scheduler's)."""
    num_used = stats.num_blocks - stats.num_free_blocks
    return RankMemoryUsage(
        rank=rank,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        memory=memory,
        num_kv_blocks=stats.num_blocks,
        num_used_kv_blocks=num_used,
        num_free_kv_blocks=stats.num_free_blocks,
        kv_cache_used_bytes=num_used * memory.kv_bytes_per_block,
        num_used_swap_blocks=num_swap_blocks - stats.num_free_swap_blocks,
    )


def trace_name(tp_rank: int, pp_rank: int) -> str:
    """A rank's trace file name (without `.json`): distinct per rank and per start."""
    return f"{TRACE_NAME}-pp{pp_rank}-tp{tp_rank}-{time.strftime('%Y%m%d-%H%M%S')}"


ADMIN_CALLS = frozenset({"memory", "snapshot", "start_profile", "stop_profile", "load_lora"})


class RankDiagnostics:
    """A rank's step statistics and profiler, around its model runner. `run_step`,
    `start_profile` and `stop_profile` run on the thread that runs the steps; `memory` and
    `snapshot` on any thread."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_stats = StepStats()
        self.profiler = Profiler(runner.device, self.step_stats)

    def run_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """`runner.execute_step`, each step recorded."""
        return run_step_recorded(self.runner, step, self.step_stats)

    def memory(self) -> RankMemory:
        return memory_stats(self.runner)

    def snapshot(self, window_s: float) -> StepStatsSnapshot:
        return self.step_stats.snapshot(window_s)

    def start_profile(
        self, out_dir: str, record_shapes: bool = False, with_stack: bool = False
    ) -> None:
        parallel = self.runner.parallel
        self.profiler.start(
            out_dir, trace_name(parallel.tp_rank, parallel.pp_rank), record_shapes, with_stack
        )

    def stop_profile(self) -> ProfileTraceFile:
        return self.profiler.stop()

    def load_lora(self, ref: LoraRef) -> None:
        """Reads and checks a LoRA adapter against this rank's shard (a ValueError naming
        what is wrong); it is then kept in memory."""
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("this engine serves no LoRA adapters")
        lora.load(ref)

    def answer(self, call: tuple[Any, ...]) -> Any:
        """One admin call as a local worker receives it: `(method name, *args)`."""
        name, *args = call
        if name not in ADMIN_CALLS:
            raise ValueError(f"unknown admin call {name!r}")
        return getattr(self, name)(*args)


class RankAdmin(Protocol):
    """The engine's ranks, as the LLM asks them; lists are in rank order."""

    def layout(self) -> list[tuple[int, int]]:
        """(tp_rank, pp_rank) of each rank."""

    def call(self, name: str, *args: Any) -> list[Any]:
        """`RankDiagnostics.<name>(*args)` on every rank, on its step thread, between steps;
        each rank's result. Raises the first rank's exception, once all have answered."""


class DiagnosedInprocExecutor(InprocExecutor):
    """`InprocExecutor` over a `RankDiagnostics`: every step recorded, and admin calls
    queued on the model thread between steps (`RankAdmin` for the one rank)."""

    def __init__(
        self,
        diagnostics: RankDiagnostics,
        thread: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        super().__init__(diagnostics.run_step, thread)
        self.diagnostics = diagnostics

    def layout(self) -> list[tuple[int, int]]:
        return [(0, 0)]

    def call(self, name: str, *args: Any) -> list[Any]:
        # InprocExecutor's one-thread pool, where the steps run: the call waits for the
        # step in flight and the next step waits for it.
        future: concurrent.futures.Future[Any] = self._thread.submit(
            self.diagnostics.answer, (name, *args)
        )
        return [future.result()]
