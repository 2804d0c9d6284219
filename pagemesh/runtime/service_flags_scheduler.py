"""The options only the scheduler takes: chunked prefill, prefix caching, async scheduling,
the scheduling policy and preemption, worker waits and step timeouts, recovery, checkpoints,
draining, and how long KV is held for the group that continues a request.
"""

from __future__ import annotations

from typing import Any

from pagemesh.runtime.service_flags_base import SCHEDULER, ServiceFlag


def _scheduler(name: str, help: str, **kwargs: Any) -> ServiceFlag:
    return ServiceFlag(name, (SCHEDULER,), help, **kwargs)


# Measured by bench/fault_tolerance.py: see bench/README.md.
CHECKPOINT_INTERVAL = 16

SCHEDULER_ONLY_OPTIONS = (
    _scheduler(
        "--enable-chunked-prefill",
        "split long prompts over several steps, sharing them with decodes",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--long-prefill-token-threshold",
        "largest prefill chunk of one request per step; 0 = no limit but the budget",
        type=int,
        default=0,
    ),
    _scheduler(
        "--enable-prefix-caching",
        "reuse the KV of prompt blocks computed before",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--async-scheduling",
        "plan the next step while one runs (groups of one rank; larger ones keep one "
        "step in flight, or one per pipeline stage)",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--scheduling-policy",
        "admission order and preemption victim: arrival, or request priority",
        default="fcfs",
        choices=("fcfs", "priority"),
    ),
    _scheduler(
        "--preemption-mode",
        "what a preempted request loses: its KV (recomputed later) or nothing (its KV "
        "moves to the workers' CPU swap space, see --swap-space; recompute when the "
        "workers have none). Swap measured faster than recompute (python -m "
        "bench.scheduling)",
        default="swap",
        choices=("recompute", "swap"),
    ),
    _scheduler(
        "--worker-wait-s",
        "seconds to wait for the group's workers to register",
        type=float,
        default=600.0,
    ),
    _scheduler(
        "--step-timeout-s",
        "seconds one step may take before it counts as failed",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--step-watchdog-s",
        "a step in flight longer than this (or than 10x the recent p99 step, if "
        "shorter; at least 1 s) gets its workers probed: one that does not answer "
        "within 2 s (frozen, cut off) fails the step and is replaced; a long step "
        "whose workers all answer goes on",
        type=float,
        default=6.0,
    ),
    _scheduler(
        "--standby-grace-s",
        "at start, seconds before a standby worker may take the rank of a worker that "
        "has not registered yet",
        type=float,
        default=60.0,
    ),
    _scheduler(
        "--recovery-timeout-s",
        "seconds to wait for a dead worker's replacement (or a standby) before the "
        "requests in flight are handed back to the routers",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--checkpoint-interval",
        "steps between checkpoint writes of the requests in flight (also written on "
        "admission and finish); 0 = no checkpoints",
        type=int,
        default=CHECKPOINT_INTERVAL,
    ),
    _scheduler(
        "--resume-window-s",
        "seconds a finished or orphaned request's checkpoint is kept for a client to resume it",
        type=float,
        default=300.0,
    ),
    _scheduler(
        "--image-store-mib",
        "MiB of images the checkpoints' image store in Redis may hold, every group's "
        "together (each image once, however many requests show it; kept a resume "
        "window after its last request's checkpoint). An image over it is not kept: "
        "its request cannot be resumed through another router",
        type=float,
        default=1024.0,
    ),
    _scheduler(
        "--drain-timeout-s",
        "on SIGTERM, seconds to let requests finish before handing the rest over "
        "(with --drain-migrate and another group ready: seconds to wait for the "
        "groups continuing them to pull their KV)",
        type=float,
        default=30.0,
    ),
    _scheduler(
        "--drain-migrate",
        "on SIGTERM, when another group of the model is ready, hand every running "
        "request over at once with its KV (the other group pulls it: nothing is "
        "recomputed) instead of letting it finish here",
        type=bool,
        default=True,
    ),
    _scheduler(
        "--kv-hold-s",
        "seconds a request's KV stays held for the group that continues it (a "
        "decode group after prefill, another group after a drain) before it is "
        "freed unclaimed; that group then recomputes it",
        type=float,
        default=30.0,
    ),
    _scheduler(
        "--kv-pull-timeout-s",
        "seconds an import of another group's KV may take (claim and every rank's "
        "pull) before the request recomputes it instead",
        type=float,
        default=10.0,
    ),
)
