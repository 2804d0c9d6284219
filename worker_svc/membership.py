"""A worker's place in its engine group over time, driven by the scheduler's rendezvous plans.

The scheduler publishes `{epoch, world_size, master_addr, master_port, members: {worker_id:
global_rank}}` at `<cluster>:rendezvous:<group>` each time it (re)forms a group. A worker
joins the first plan that names it. Once ready (in a multi-worker group) it keeps polling
the key, and a plan with a new epoch that names it with its own rank makes it re-form its
process group in place: weights and KV cache stay, request state goes (the scheduler
re-sends every request in full, from step 0 of a session). A plan that leaves it out, or
gives it another rank, changes nothing; neither does a missing key (a restarted Redis).
Each epoch is acted on at most once: a join that failed waits for the next plan.

A step session (a scheduler's numbering of its steps) is taken only from the group's
current scheduler: `check_session` looks for a scheduler entry of this group that names the
session and this worker's epoch. A scheduler that lost its claim (replaced after a
partition), or anyone else who reaches the port, cannot start driving the worker.

Statuses published in the registry entry (pagemesh.runtime.registry_entries.WorkerStatus): joining
->
loading -> ready at start (standby -> joining -> loading -> ready for a --standby worker),
ready -> joining -> ready on a re-form. `epoch` is the plan whose process group the worker
is in ("" while in none).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from pagemesh.runtime.registry import Registry
from pagemesh.runtime.registry_entries import SchedulerEntry, WorkerStatus
from pagemesh.runtime.serving import ServiceError
from worker_svc.runner import ModelRunner
from worker_svc.servicer import WorkerServicer

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
# How long a new step session may wait for its scheduler's entry to name it (a heartbeat
# written just before the announcement may land after it, with the previous session).
SESSION_WAIT_S = 5.0

T = TypeVar("T")
JoinFn = Callable[["Plan", Callable[[], bool]], Awaitable[T]]  # (plan, should_abort) -> joined


@dataclass(frozen=True)
class Plan:
    """One formation of the group, as the scheduler published it."""

    epoch: str
    world_size: int
    master_addr: str
    master_port: int
    members: dict[str, int]  # worker id -> global rank (pp_rank * tp_size + tp_rank)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Plan:
        plan = cls(
            str(raw["epoch"]),
            int(raw["world_size"]),
            str(raw["master_addr"]),
            int(raw["master_port"]),
            {str(wid): int(rank) for wid, rank in raw["members"].items()},
        )
        if not plan.epoch:
            raise ValueError("empty epoch")
        return plan


@dataclass
class WorkerState:
    """The part of a worker's registry entry (pagemesh.runtime.registry_entries.WorkerEntry) that
    changes while it runs; the heartbeat publishes it as it is then."""

    status: WorkerStatus
    epoch: str = ""  # the plan whose process group the worker is in, "" while in none
    num_reforms: int = 0
    quantization: str | None = None  # once the model is loaded
    weight_bytes: int | None = None


class Membership:
    """Follows one engine group's rendezvous plans on behalf of one worker.

    `state` is what the worker publishes about its place (changed in place); `publish()`
    writes the registry entry at once instead of at the next heartbeat.
    """

    def __init__(
        self,
        registry: Registry,
        group: str,
        worker_id: str,
        world_size: int,
        state: WorkerState,
        publish: Callable[[], Awaitable[None]],
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        self.registry = registry
        self.group = group
        self.worker_id = worker_id
        self.world_size = world_size
        self.state = state
        self.publish = publish
        self.poll_interval_s = poll_interval_s
        self._acted_on: set[str] = set()  # epochs joined, failed or refused: never again
        self._redis_failing = False

    async def set_status(self, status: WorkerStatus, epoch: str | None = None) -> None:
        self.state.status = status
        if epoch is not None:
            self.state.epoch = epoch
        try:
            await self.publish()
        except Exception as exc:  # the heartbeat publishes it once Redis answers again
            logger.warning("could not publish status %s: %s", status, exc)

    async def check_session(self, session_id: str) -> None:
        """Returns once a scheduler entry of this group names `session_id` and this worker's
        epoch; raises ServiceError (PERMISSION_DENIED) after SESSION_WAIT_S if none does,
        UNAVAILABLE if Redis cannot say."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SESSION_WAIT_S
        while True:
            try:
                entries = await self.registry.entries(SchedulerEntry)
            except Exception as exc:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"cannot check step session {session_id} against the "
                    f"registry ({exc}); retry once Redis answers",
                ) from exc
            mine = {sid: e for sid, e in entries.items() if (e.group or sid) == self.group}
            # A single worker needs no process group: its scheduler publishes no epoch.
            if any(
                e.session == session_id and (self.world_size == 1 or e.epoch == self.state.epoch)
                for e in mine.values()
            ):
                return
            if loop.time() >= deadline:
                break
            await asyncio.sleep(0.1)
        held = (
            ", ".join(
                f"{sid}: session {e.session or '-'} epoch {e.epoch or '-'}"
                for sid, e in mine.items()
            )
            or "no scheduler registered"
        )
        raise ServiceError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"step session {session_id} is not the one group {self.group}'s scheduler "
            f"registered for epoch {self.state.epoch or '-'} ({held}): only the group's "
            "current scheduler may drive this worker",
        )

    async def skip_current_plan(self) -> None:
        """Call before registering: a plan already published is an earlier process's (this
        id's predecessor), whose group formed without this one; its epoch is not joined."""
        plan = await self.read_plan()
        if plan is not None:
            self._acted_on.add(plan.epoch)

    async def read_plan(self) -> Plan | None:
        """The published plan; None when there is none, it is malformed or Redis is away."""
        try:
            raw = await self.registry.get_rendezvous(self.group)
        except Exception as exc:
            if not self._redis_failing:
                logger.warning(
                    "cannot read the rendezvous of group %s (%s); retrying", self.group, exc
                )
            self._redis_failing = True
            return None
        if self._redis_failing:
            logger.info("rendezvous of group %s readable again", self.group)
            self._redis_failing = False
        if raw is None:
            return None
        try:
            return Plan.from_json(raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.debug("ignoring a malformed rendezvous plan %r: %s", raw, exc)
            return None

    async def next_plan(self, rank: int | None) -> Plan:
        """The first plan not acted on yet that names this worker with `rank` (any rank of
        the group when None). A plan with another rank or world size is logged and skipped."""
        while True:
            plan = await self.read_plan()
            if (
                plan is not None
                and plan.epoch not in self._acted_on
                and self.worker_id in plan.members
            ):
                given = plan.members[self.worker_id]
                if plan.world_size != self.world_size or not 0 <= given < self.world_size:
                    logger.error(
                        "rendezvous epoch %s (world size %d, rank %d) does not fit "
                        "this worker's group of %d: ignored",
                        plan.epoch,
                        plan.world_size,
                        given,
                        self.world_size,
                    )
                elif rank is not None and given != rank:
                    logger.error(
                        "rendezvous epoch %s gives this worker rank %d, but it holds "
                        "rank %d: ignored",
                        plan.epoch,
                        given,
                        rank,
                    )
                else:
                    return plan
                self._acted_on.add(plan.epoch)
            await asyncio.sleep(self.poll_interval_s)

    async def join(self, rank: int | None, join_fn: JoinFn[T]) -> tuple[Plan, T]:
        """Waits for a plan for `rank` (see `next_plan`) and runs `join_fn(plan,
        should_abort)`. A join that fails, or is called off because another epoch was
        published meanwhile, waits for the next plan."""
        while True:
            plan = await self.next_plan(rank)
            self._acted_on.add(plan.epoch)
            logger.info(
                "joining group %s epoch %s via %s:%d as rank %d",
                self.group,
                plan.epoch,
                plan.master_addr,
                plan.master_port,
                plan.members[self.worker_id],
            )
            superseded = threading.Event()  # read by the joining thread
            watcher = asyncio.create_task(self._watch_for_newer(plan.epoch, superseded))
            try:
                return plan, await join_fn(plan, superseded.is_set)
            except Exception as exc:
                logger.error(
                    "joining group %s epoch %s failed (%s: %s); waiting for a new plan",
                    self.group,
                    plan.epoch,
                    type(exc).__name__,
                    exc,
                )
            finally:
                watcher.cancel()
                superseded.set()  # a join still running after a cancellation gives up

    async def _watch_for_newer(self, epoch: str, superseded: threading.Event) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            plan = await self.read_plan()
            if plan is not None and plan.epoch != epoch:
                logger.warning("epoch %s superseded by %s while joining", epoch, plan.epoch)
                superseded.set()
                return

    async def follow(self, servicer: WorkerServicer, runner: ModelRunner, timeout_s: float) -> None:
        """Re-forms the process group whenever a new plan names this worker with its rank.
        Runs until cancelled."""
        rank = runner.dist.parallel.rank
        while True:
            try:
                await self.next_plan(rank)  # `_reform` joins it (or a newer one)
                await self._reform(servicer, runner, timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep following: a worker that stops watching is stranded
                logger.exception("following the rendezvous of group %s", self.group)
                await asyncio.sleep(self.poll_interval_s)

    async def _reform(
        self, servicer: WorkerServicer, runner: ModelRunner, timeout_s: float
    ) -> None:
        start_s = time.monotonic()
        logger.info("group %s re-forms: leaving epoch %s", self.group, self.state.epoch)
        await servicer.stop_steps()
        await self.set_status(WorkerStatus.JOINING, epoch="")

        async def rejoin(plan: Plan, should_abort: Callable[[], bool]) -> None:
            # On the model thread: after the step in progress, which a dead peer fails.
            await servicer.run_on_model_thread(_reform_group, runner, plan, timeout_s, should_abort)

        plan, _ = await self.join(runner.dist.parallel.rank, rejoin)
        self.state.num_reforms += 1
        await servicer.resume_steps()  # before ready: the scheduler sends steps on seeing it
        await self.set_status(WorkerStatus.READY, epoch=plan.epoch)
        logger.info(
            "re-formed group %s in epoch %s in %.2f s; weights kept",
            self.group,
            plan.epoch,
            time.monotonic() - start_s,
        )


def _reform_group(
    runner: ModelRunner, plan: Plan, timeout_s: float, should_abort: Callable[[], bool]
) -> None:
    runner.reset_requests()
    runner.dist.reform(
        plan.master_addr, plan.master_port, timeout_s, tag=plan.epoch, should_abort=should_abort
    )
    runner.reset_expert_placement()  # a standby that took a rank loaded the default
