"""One router request's life on the scheduler, whichever call carries it (a `Submit` of its
own, or a router's multiplexed `Connect`): admission, its events, its checkpoint, its
spans. The servicer and the connection convert and move messages (`convert/`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate

from pagemesh.runtime.registry_entries import GroupStatus
from pagemesh.runtime.serving import ServiceError, invalid_argument
from protos.step import RequestId
from scheduler_svc.checkpoint import Checkpointer, admitted_samples
from scheduler_svc.core.admission import sample_index
from scheduler_svc.core.scheduler import CapacityError
from scheduler_svc.core.types import RequestEvent
from scheduler_svc.engine_loop import EngineLoop, RequestSink
from scheduler_svc.kv_moves import KVMoves
from scheduler_svc.messages import Submission
from scheduler_svc.tracing import RequestTrace

logger = logging.getLogger(__name__)


@dataclass
class OpenRequest:
    """A router request (all its samples) streaming from here."""

    request_id: str
    n: int
    with_logprobs: bool
    unfinished: set[RequestId]  # core ids (`<id>` or `<id>#<i>`) not ended yet
    trace: RequestTrace | None = None
    # (sample index, final event) of samples that ended while admitted (a resume that
    # lost the end): sent at once.
    ended: list[tuple[int, RequestEvent]] = field(default_factory=list)
    # Samples that ended here unfinished, their KV handed off to the group that continues
    # them: the request's checkpoint is left for that group (orphaned), not finished.
    handed_off: bool = False

    @property
    def finished(self) -> bool:
        return not self.unfinished


class RequestStreams:
    """Admits requests into the engine loop and follows their events, keeping each
    request's checkpoint current. Raises `ServiceError`s with the status the request
    (alone) fails with."""

    def __init__(
        self,
        loop: EngineLoop,
        checkpointer: Checkpointer | None = None,
        kv_moves: KVMoves | None = None,
        prefill_only: bool = False,
    ) -> None:
        self.loop = loop
        self.checkpointer = checkpointer or Checkpointer(None, "", 0, 0.0)
        self.kv_moves = kv_moves
        # A prefill group (`--role prefill`): a new request's samples stop after their first
        # token, their KV held for a decode group (the router resumes them there).
        self.prefill_only = prefill_only

    def admit(
        self, submission: Submission, sink: RequestSink, traced_from_message: bool = False
    ) -> OpenRequest:
        """Queues the request's samples with `sink` receiving their events. The trace
        parent is the caller's current context, or with `traced_from_message` the
        request's own `trace_context` (a multiplexed stream has one context for all)."""
        if self.loop.status == GroupStatus.DRAINING:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "this scheduler is draining; send the request to another group",
            )
        self._queue(submission, sink)
        request_id = submission.request_id
        if submission.resumed:
            logger.info(
                "resuming request %s after %s tokens",
                request_id,
                [len(token_ids) for token_ids, _ in submission.progress.values()],
            )
        if not submission.embeds:  # an embedding is recomputed whole after a failure
            self.checkpointer.track(
                request_id, submission.original, admitted_samples(submission), submission.images
            )
        opened = OpenRequest(
            request_id,
            submission.n,
            submission.with_logprobs,
            {r.request_id for r in submission.requests},
        )
        opened.ended = self._ended(submission)
        context = (
            propagate.extract(submission.trace_context)
            if traced_from_message and submission.trace_context
            else None
        )
        opened.trace = self.loop.tracing.start(
            request_id,
            submission.requests,
            submission.num_prompt_tokens,
            submission.resumed,
            context,
            make_current=not traced_from_message,
        )
        return opened

    def _queue(self, submission: Submission, sink: RequestSink) -> None:
        """The samples that still run, queued. A resume whose previous stream is still
        ending here supersedes it (or fails ABORTED for the router to retry)."""
        requests = submission.requests
        if self.prefill_only and not submission.resumed and self.kv_moves is not None:
            for request in requests:  # stop after the first token, KV held (core/kv_moves.py)
                request.hand_off_below, request.max_tokens = request.max_tokens, 1
        handoffs = {
            r.request_id: submission.kv_handoffs[sample_index(r.request_id, submission.n)]
            for r in requests
            if sample_index(r.request_id, submission.n) in submission.kv_handoffs
        }
        if self.kv_moves is None:
            handoffs = {}
        try:
            live = [r.request_id for r in requests if r.request_id in self.loop.scheduler.requests]
            if live and submission.resumed and not self.loop.supersede(live):
                raise ServiceError(
                    grpc.StatusCode.ABORTED,
                    "the request's previous stream is still ending here; retry",
                )
            imports = self.loop.submit(requests, sink, handoffs)
            if self.kv_moves is not None:
                self.kv_moves.pull(imports)
                pulled = {job.request.request_id for job in imports}
                self.kv_moves.dismiss([h for rid, h in handoffs.items() if rid not in pulled])
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc

    def _ended(self, submission: Submission) -> list[tuple[int, RequestEvent]]:
        """Final events for resumed samples whose tokens already end them (the router lost
        their last message), recorded in the checkpoint."""
        ended = []
        for index, reason in submission.ended:
            event = RequestEvent(
                RequestId(submission.request_id), (), reason, submission.num_prompt_tokens
            )
            self.checkpointer.record(submission.request_id, index, event)
            ended.append((index, event))
        return ended

    def record(self, opened: OpenRequest, event: RequestEvent) -> int:
        """Records one event in the checkpoint; returns its sample's index. The caller
        finishes the checkpoint (`finish`) before the message of the request's last sample
        goes out."""
        index = sample_index(event.request_id, opened.n)
        self.checkpointer.record(opened.request_id, index, event)
        if event.ends_stream:
            opened.unfinished.discard(event.request_id)
            if event.handoff is not None:
                opened.handed_off = True
                if self.kv_moves is not None:
                    self.kv_moves.counts.holds += 1
        return index

    async def finish(self, opened: list[OpenRequest]) -> None:
        """Requests whose every sample ended: their complete checkpoints, in one write (a
        request with samples handed off goes on elsewhere: its record is left for that
        group, orphaned)."""
        for handed in [o for o in opened if o.handed_off]:
            self.checkpointer.orphan(handed.request_id)
        await self.checkpointer.finish_many([o.request_id for o in opened if not o.handed_off])

    def failed(self, opened: OpenRequest, message: str) -> None:
        """The request cannot go on here (its router resumes it elsewhere)."""
        self.loop.tracing.fail(opened.trace, message)

    def close(self, opened: OpenRequest) -> None:
        """The stream is over: a request left unfinished (its router cancelled or went away,
        or this group gave up) keeps its checkpoint for a resume and is aborted here."""
        if opened.unfinished:
            logger.info("request %s left unfinished", opened.request_id)
            self.checkpointer.orphan(opened.request_id)
            for request_id in opened.unfinished:
                self.loop.abort(request_id)
            opened.unfinished = set()
        self.loop.tracing.end(opened.trace)
        opened.trace = None
