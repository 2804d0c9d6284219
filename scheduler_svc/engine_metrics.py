"""The scheduler's Prometheus metrics (pagemesh/runtime/metrics_scheduler.py), fed from the
engine loop.

The core stays free of metrics: gauges and counters are read from `loop.scheduler` at scrape
time (always through the loop: a recovery replaces the core), histograms are observed by the
loop's `on_schedule` and `on_step` hooks.
"""

from __future__ import annotations

import time

from pagemesh.runtime.metrics_scheduler import EngineSnapshot, SchedulerMetrics
from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import GroupStatus
from protos.step import SchedulerOutput
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine_loop import EngineLoop

# Prefix-cache queries and hits (tokens), preemptions, swap-outs, swap-ins, drafts verified,
# their tokens and the tokens kept (speculative decoding).
_Counts = tuple[int, int, int, int, int, int, int, int]


def _counts(core: Scheduler) -> _Counts:
    spec = core.spec
    return (
        core.kv.prefix_cache_queries,
        core.kv.prefix_cache_hits,
        core.num_preemptions,
        core.num_swap_outs,
        core.num_swap_ins,
        spec.num_drafts if spec else 0,
        spec.num_draft_tokens if spec else 0,
        spec.num_accepted_tokens if spec else 0,
    )


class CoreTotals:
    """The core's cumulative counters over the life of the process. A recovery replaces the
    core and its counters start again from 0; the replaced core's final counts are carried
    over, so that the exported counters never go back."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self._core = loop.scheduler
        self._carried: _Counts = (0, 0, 0, 0, 0, 0, 0, 0)

    def read(self) -> _Counts:
        core = self._loop.scheduler
        if core is not self._core:
            old = _counts(self._core)
            self._carried = tuple(a + b for a, b in zip(self._carried, old))  # type: ignore[assignment]
            self._core = core
        return tuple(a + b for a, b in zip(self._carried, _counts(core)))  # type: ignore[return-value]

    async def on_status(self, status: GroupStatus) -> None:
        """Every recovery ends with a status change to ready, right after the core was
        replaced: reading then carries the old core over even with no scrape in between."""
        self.read()


def snapshot(loop: EngineLoop, totals: CoreTotals, checkpointer: Checkpointer) -> EngineSnapshot:
    stats = loop.scheduler.stats()
    queries, hits, preemptions, swap_outs, swap_ins, drafts, drafted, kept = totals.read()
    return EngineSnapshot(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting - stats.num_swapped,
        num_swapped=stats.num_swapped,
        kv_cache_usage=1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_preemptions=preemptions,
        num_swap_outs=swap_outs,
        num_swap_ins=swap_ins,
        num_recoveries=loop.num_recoveries,
        ready=loop.status == GroupStatus.READY,
        num_checkpoint_writes=checkpointer.num_writes,
        num_drafts=drafts,
        num_draft_tokens=drafted,
        num_accepted_tokens=kept,
    )


def observe_engine(
    metrics: SchedulerMetrics, loop: EngineLoop, checkpointer: Checkpointer, registry: Registry
) -> None:
    """Wires `metrics` to the loop: scrape-time reads, and the per-step histograms."""
    metrics.follow_heartbeat(lambda: registry.last_heartbeat_s)
    totals = CoreTotals(loop)
    loop.on_status.append(totals.on_status)
    loop.on_schedule.append(lambda output: _on_schedule(metrics, loop, output))
    loop.on_step.append(lambda: metrics.step_time.observe(loop.last_step_time_ms / 1000))
    metrics.follow_engine(lambda: snapshot(loop, totals, checkpointer))


def _on_schedule(metrics: SchedulerMetrics, loop: EngineLoop, output: SchedulerOutput) -> None:
    metrics.scheduled_tokens_per_step.observe(output.total_num_scheduled_tokens)
    now_s = time.time()  # the clock of `Request.arrival_time_s` (scheduler_svc/servicer.py)
    requests = loop.scheduler.requests
    for new in output.new_requests:
        request = requests.get(new.request_id)
        # First scheduled: never preempted, nothing generated yet. (A request carried over a
        # recovery before its first token is observed again, from its original arrival.)
        if (
            request is not None
            and request.arrival_time_s > 0
            and not request.num_preemptions
            and not request.output_token_ids
        ):
            metrics.request_queue_time.observe(max(0.0, now_s - request.arrival_time_s))
