"""The request path: each request to an engine group, and on to another when that one fails.

`Dispatcher.stream` picks a group for a request (router/routing.py's policy, within the best
tier of the groups router/group_directory.py knows), sends it there, and, when the group
fails the stream with a retryable status (router/resume.py), sends it with its progress to
another group (or the failed one's replacement), so the caller sees one continuous stream.
It also counts the tokens of this router's requests in flight per group, the load the
routing policy balances.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

import grpc
from opentelemetry import trace

from pagemesh.runtime.registry_entries import GroupStatus
from pagemesh.runtime.serving import ServiceError, unavailable
from pagemesh.runtime.telemetry import grpc_metadata
from protos.block_hash import BlockHash, adapter_extra, hash_request_blocks
from router.group_directory import EngineGroup, GroupDirectory
from router.request_feed import HandedOver, RequestFeed
from router.resume import Attempts, Progress, ResumeConfig, retry_kind
from router.routing import GroupLoad, RoutingConfig, RoutingPolicy
from router.tracing import group_failed_event, resume_event
from router.types import SampleOutput, Submission

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Dispatcher:
    def __init__(
        self,
        directory: GroupDirectory,
        routing: RoutingConfig | None = None,
        resume: ResumeConfig | None = None,
    ) -> None:
        self.directory = directory
        self.resume = resume or ResumeConfig()
        self._policy = RoutingPolicy(routing or RoutingConfig())
        directory.on_group_reset.append(self._policy.index.forget_group)
        # Tokens (prompt + still to generate) of this router's requests in flight per group;
        # a group leaves the dict once it has none.
        self._outstanding: dict[str, int] = {}
        # Streams resumed on a group after the one serving them failed (router metrics).
        self.num_resumes = 0
        # Attempts that ended with every unfinished sample's KV handed off (disaggregated
        # prefill, a drain), continued on another group.
        self.num_handoffs = 0

    async def stream(
        self,
        submission: Submission,
        process: Callable[[SampleOutput], T | None],
        progress: Progress | None = None,
        span: trace.Span | None = None,
    ) -> AsyncIterator[list[T]]:
        """Streams a request as one continuous stream, whatever fails underneath: for each
        step, the list of what `process` returned for the request's outputs in it (Nones
        left out). `process` runs in the stream reader's pass over the step
        (router/request_feed.py): it must not await, and it marks samples a stop string
        ended with `progress.finish(i)`. The stream ends once every sample finished.

        `progress` (updated in place as tokens arrive) is what each sample already produced:
        empty for a fresh request, a checkpoint's for a resume on a new router. When a group
        fails the stream with a retryable status (router/resume.py), the same request plus
        `progress` goes to another group (or the failed one's replacement) and the stream goes
        on after the last token received. A group that fails before the first token is
        replaced the same way. `span` (the request's Generate span) goes to every attempt as
        its parent; failures and resumes are its events.
        """
        progress = progress or Progress.fresh(submission.n)
        metadata = grpc_metadata(span)
        info = await self.directory.model_info()
        adapter = adapter_extra(submission.lora_name) if submission.lora_name else b""
        block_hashes = hash_request_blocks(
            list(submission.prompt_token_ids), info.block_size, adapter, images=submission.images
        )
        attempts = Attempts(self.resume, asyncio.get_running_loop().time, progress.started)
        feed: RequestFeed[T] = RequestFeed(progress, attempts, process)
        handed_from: frozenset[str] = frozenset()
        while not progress.all_finished:
            group = await self._choose(
                block_hashes,
                attempts,
                submission.lora_name,
                decode=progress.started,
                avoid=handed_from,
            )
            handed_from = frozenset()
            if attempts.num_failures:
                self.num_resumes += 1
                logger.warning(
                    "request %s resumed on engine group %s with %s output tokens "
                    "already received (per sample)",
                    submission.request_id,
                    group.scheduler_id,
                    progress.num_tokens(),
                )
                resume_event(span, group.scheduler_id, progress.num_tokens())
            try:
                with self._attempt(group, submission, progress, feed, block_hashes, metadata):
                    while (batch := await feed.next_batch()) is not None:
                        yield batch
                return
            except HandedOver:  # its KV waits there for the group that continues it
                self.num_handoffs += 1
                handed_from = frozenset({group.scheduler_id})
                continue
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or str(exc.code())
            except grpc.aio.UsageError as exc:  # its channel was closed under it
                code, details = grpc.StatusCode.CANCELLED, str(exc)
            group_failed_event(span, group.scheduler_id, code, details)
            self._failed(group, submission, progress, attempts, code, details)

    def _pick(
        self,
        block_hashes: list[BlockHash],
        exclude: frozenset[str],
        lora_name: str = "",
        decode: bool = False,
    ) -> EngineGroup | None:
        """The routing policy's choice within the best non-empty tier: ready groups present in
        the registry and not just failed, then ready ones missing or just failed, then the
        rest (degraded, NOT_SERVING, unreachable). Draining groups, `exclude` and groups that
        serve no LoRA (for a request naming an adapter) are never picked; within the tier, a
        request naming an adapter goes where it is held first (`adapter_groups`), and
        disaggregated groups by phase: a new request (`decode` False) to a prefill group, a
        started one to a decode group, when the tier has one (else to any)."""
        now = asyncio.get_running_loop().time()
        tiers: list[list[GroupLoad]] = [[], [], []]
        for group in self.directory.groups:
            if group.scheduler_id in exclude or group.status == GroupStatus.DRAINING:
                continue
            if lora_name and not group.may_serve(lora_name):
                continue
            load = dataclasses.replace(
                group.load, outstanding_tokens=self._outstanding.get(group.scheduler_id, 0)
            )
            if not group.ready:
                tiers[2].append(load)
            elif group.missing_since is not None or group.suspect_until > now:
                tiers[1].append(load)
            else:
                tiers[0].append(load)
        for loads in tiers:
            if loads:
                loads = self._phase_groups(loads, decode)
                if lora_name:
                    loads = self._adapter_groups(loads, lora_name)
                scheduler_id = self._policy.pick(loads, block_hashes)
                return self.directory.get(scheduler_id) if scheduler_id is not None else None
        return None

    def _phase_groups(self, loads: list[GroupLoad], decode: bool) -> list[GroupLoad]:
        roles = ("decode", "both") if decode else ("prefill",)
        preferred = [ld for ld in loads if self.directory.get(ld.scheduler_id).role in roles]
        return preferred or loads

    def _adapter_groups(self, loads: list[GroupLoad], lora_name: str) -> list[GroupLoad]:
        groups = [self.directory.get(load.scheduler_id) for load in loads]
        holders = [ld for ld, g in zip(loads, groups) if lora_name in g.loras]
        with_room = [
            ld for ld, g in zip(loads, groups) if lora_name not in g.loras and g.has_room()
        ]
        full = [ld for ld, g in zip(loads, groups) if lora_name not in g.loras and not g.has_room()]
        return list(self._policy.adapter_groups(holders, with_room, full))

    async def _choose(
        self,
        block_hashes: list[BlockHash],
        attempts: Attempts,
        lora_name: str = "",
        decode: bool = False,
        avoid: frozenset[str] = frozenset(),
    ) -> EngineGroup:
        """A group for the next attempt: another one at once when there is one; else, once the
        request was accepted somewhere, any (the failed group's replacement too) after a
        backoff, until the resume timeout."""
        # The group that just handed the request over: another one when there is one.
        if avoid and self._pick(block_hashes, attempts.excluded | avoid, lora_name, decode):
            exclude = attempts.excluded | avoid
        else:
            exclude = attempts.excluded
        while True:
            group = self._pick(block_hashes, exclude, lora_name, decode)
            if group is not None:
                return group
            if not attempts.may_wait:
                raise unavailable("no engine group could take the request; retry shortly")
            if attempts.remaining_s() <= 0:
                raise unavailable(
                    f"the engine group serving the request failed and no engine "
                    f"group took it back within --resume-timeout-s "
                    f"{self.resume.timeout_s:g}"
                )
            await asyncio.sleep(attempts.next_backoff_s())
            exclude = frozenset()

    def _failed(
        self,
        group: EngineGroup,
        submission: Submission,
        progress: Progress,
        attempts: Attempts,
        code: grpc.StatusCode | None,
        details: str,
    ) -> None:
        """Logs a failed attempt; raises the error the client sees when it is not retried."""
        kind = retry_kind(code)
        if kind is None:
            assert code is not None
            raise ServiceError(code, details)
        give_up = attempts.failed(group.scheduler_id, code)
        if give_up is not None:
            logger.warning(
                "request %s: engine group %s failed (%s: %s); giving up: %s",
                submission.request_id,
                group.scheduler_id,
                code.name if code else "early end",
                details,
                give_up,
            )
            final = (
                grpc.StatusCode.UNAVAILABLE
                if kind == "peer_gone"
                else (code or grpc.StatusCode.INTERNAL)
            )
            raise ServiceError(final, f"{details} ({give_up})")
        group.suspect_until = asyncio.get_running_loop().time() + self.directory.ttl_s
        logger.warning(
            "request %s: engine group %s failed (%s: %s) after %s output tokens "
            "(per sample); resuming",
            submission.request_id,
            group.scheduler_id,
            code.name if code else "early end",
            details,
            progress.num_tokens(),
        )

    @contextlib.contextmanager
    def _attempt(
        self,
        group: EngineGroup,
        submission: Submission,
        progress: Progress,
        feed: RequestFeed[T],
        block_hashes: list[BlockHash],
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> Iterator[None]:
        """One attempt on one group: the request on its stream, with `progress` once anything
        was produced (or on a resume), its outputs into `feed`. `_outstanding` counts prompt +
        max_tokens of each unfinished sample while it lasts (recomputed outputs are bounded by
        max_tokens too)."""
        num_tokens = (
            len(submission.prompt_token_ids) + submission.max_tokens * progress.num_unfinished
        )
        scheduler_id = group.scheduler_id
        self._policy.record(block_hashes, scheduler_id)
        self._outstanding[scheduler_id] = self._outstanding.get(scheduler_id, 0) + num_tokens
        progress.served_by(group.name)
        feed.on_progress = group.not_suspect
        feed.source_address = group.address
        try:
            with group.conn.submitted(
                submission, progress if progress.started else None, feed, metadata
            ):
                yield
        finally:
            self._give_back(scheduler_id, num_tokens)

    def _give_back(self, scheduler_id: str, num_tokens: int) -> None:
        remaining = self._outstanding[scheduler_id] - num_tokens
        if remaining:
            self._outstanding[scheduler_id] = remaining
        else:
            del self._outstanding[scheduler_id]
