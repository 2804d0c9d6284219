"""`LLM`'s diagnostics (offline/llm.py): what the mesh's `pagemesh.v1.Admin` answers for a
group (`pagemesh admin ...`), for this engine's ranks: memory, step figures, profiler
traces (offline/diagnostics.py holds the ranks' side)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from offline.diagnostics import RankAdmin, RankMemoryUsage, RankStepStats, memory_usage

if TYPE_CHECKING:
    from offline.engine import EngineCore

MIB = 1 << 20


class Diagnostics:
    """`LLM`'s admin calls (it inherits them, and sets these in its __init__). Ranks are
    listed in order: rank = pp_rank * tp_size + tp_rank."""

    _ranks: RankAdmin  # the engine's ranks, in this process or local worker processes
    _num_swap_blocks: int

    def get_memory(self) -> list[RankMemoryUsage]:
        """Each rank's memory now: `memory` (worker_svc.diagnostics.RankMemory: weights, KV
        cache and swap space as allocated, process RSS, CUDA allocator figures; bytes) and
        the engine's KV blocks in use and free, in blocks
        (`num_used_kv_blocks + num_free_kv_blocks == num_kv_blocks`) and bytes
        (`kv_cache_used_bytes`). Waits for the step in flight, if any."""
        engine = self._live_engine()
        memories = self._ranks.call("memory")
        assert engine.engine_loop is not None
        stats = engine.call(engine.engine_loop.scheduler.stats)
        return [
            memory_usage(rank, tp_rank, pp_rank, memory, stats, self._num_swap_blocks)
            for rank, ((tp_rank, pp_rank), memory) in enumerate(
                zip(self._ranks.layout(), memories, strict=True)
            )
        ]

    def get_step_stats(self, window_s: float = 60.0) -> list[RankStepStats]:
        """Each rank's step figures (`stats`, a worker_svc.diagnostics.StepStatsSnapshot):
        steps, busy seconds and, of them, collective and pipeline-transfer seconds, since
        the LLM started and over the last `window_s` seconds (at most an hour; shorter
        while the LLM is younger); `stats.utilization` is the window's busy fraction, 0..1.
        Raises ValueError unless `window_s > 0`."""
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0 (seconds), got {window_s!r}")
        self._live_engine()
        snapshots = self._ranks.call("snapshot", float(window_s))
        return [
            RankStepStats(rank, tp_rank, pp_rank, snapshot)
            for rank, ((tp_rank, pp_rank), snapshot) in enumerate(
                zip(self._ranks.layout(), snapshots, strict=True)
            )
        ]

    def start_profile(
        self, out_dir: str, *, record_shapes: bool = False, with_stack: bool = False
    ) -> None:
        """Starts a torch.profiler trace on every rank (CPU ops, and CUDA kernels on a
        GPU), on the thread that runs its steps; `stop_profile` writes one Chrome trace
        JSON per rank into `out_dir` (created now). Raises
        worker_svc.diagnostics.ProfilerStateError when a trace already runs, OSError when
        `out_dir` cannot be written."""
        self._live_engine()
        self._ranks.call("start_profile", str(out_dir), record_shapes, with_stack)

    def stop_profile(self) -> list[str]:
        """Stops the trace and writes it: the absolute path of each rank's trace file
        (`<out_dir>/pagemesh-pp<P>-tp<T>-<time>.json`, for chrome://tracing or Perfetto),
        in rank order. Raises ProfilerStateError when no trace runs."""
        self._live_engine()
        return [trace.path for trace in self._ranks.call("stop_profile")]

    def print_memory_stats(self, file: TextIO | None = None) -> None:
        """Prints `get_memory()` as a table, one line per rank (MiB, and KV blocks)."""
        out = file if file is not None else sys.stdout
        print(
            f"{'rank':>4} {'tp':>2} {'pp':>2} {'device':<8} {'weights':>9} "
            f"{'KV used/total blocks':>21} {'KV used':>9} {'KV alloc':>9} {'swap':>9} "
            f"{'RSS':>9}  (MiB)",
            file=out,
        )
        for m in self.get_memory():
            print(
                f"{m.rank:>4} {m.tp_rank:>2} {m.pp_rank:>2} {m.memory.device:<8} "
                f"{m.memory.weight_bytes / MIB:>9.1f} "
                f"{f'{m.num_used_kv_blocks}/{m.num_kv_blocks}':>21} "
                f"{m.kv_cache_used_bytes / MIB:>9.1f} {m.memory.kv_cache_bytes / MIB:>9.1f} "
                f"{m.memory.swap_bytes / MIB:>9.1f} {m.memory.rss_bytes / MIB:>9.1f}",
                file=out,
            )

    if TYPE_CHECKING:  # provided by LLM

        def _live_engine(self) -> EngineCore: ...
