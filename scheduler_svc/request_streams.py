"""One router request's life on the scheduler, whichever call carries it (a `Submit` of its
own, or a router's multiplexed `Connect`): admission, its outputs as protobuf, its
checkpoint, its spans. The servicer and the connection only move messages."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate

from pagemesh.checkpoints import SampleState
from pagemesh.registry_entries import GroupStatus
from pagemesh.serving import ServiceError, invalid_argument
from protos.pagemesh.scheduler.v1 import scheduler_pb2
from protos.step import RequestId
from scheduler_svc import convert
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.admission import sample_index
from scheduler_svc.core.scheduler import CapacityError
from scheduler_svc.core.types import Request, RequestEvent
from scheduler_svc.engine_loop import EngineLoop, RequestSink
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
    # Final messages of samples that ended while admitted (a resume that lost the end).
    initial: list[scheduler_pb2.SubmitResponse] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return not self.unfinished


class RequestStreams:
    """Admits requests into the engine loop and turns their events into `SubmitResponse`s,
    keeping each request's checkpoint current. Raises `ServiceError`s with the status the
    request (alone) fails with."""

    def __init__(self, loop: EngineLoop, eos_token_ids: list[int],
                 checkpointer: Checkpointer | None = None) -> None:
        self.loop = loop
        self.checkpointer = checkpointer or Checkpointer(None, "", 0, 0.0)
        self._eos_token_ids = eos_token_ids

    def admit(self, request: scheduler_pb2.SubmitRequest, sink: RequestSink,
              traced_from_message: bool = False) -> OpenRequest:
        """Queues the request's samples with `sink` receiving their events. The trace
        parent is the caller's current context, or with `traced_from_message` the
        request's own `trace_context` (a multiplexed stream has one context for all)."""
        if self.loop.status == GroupStatus.DRAINING:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "this scheduler is draining; send the request to another group")
        if not request.request_id:
            raise invalid_argument("request_id is empty: every request needs an id")
        requests = self._queue(request, sink)
        n = max(request.n, 1)
        if request.progress:
            logger.info("resuming request %s after %s tokens", request.request_id,
                        [len(p.token_ids) for p in request.progress])
        self.checkpointer.track(request.request_id, _original(request), _samples(request, n))
        opened = OpenRequest(request.request_id, n, request.logprobs > 0,
                             {r.request_id for r in requests})
        opened.initial = self._ended_replies(request, opened)
        context = (propagate.extract(dict(request.trace_context))
                   if traced_from_message and request.trace_context else None)
        opened.trace = self.loop.tracing.start(request.request_id, requests,
                                               len(request.prompt_token_ids),
                                               bool(request.progress), context,
                                               make_current=not traced_from_message)
        return opened

    def _queue(self, request: scheduler_pb2.SubmitRequest, sink: RequestSink) -> list[Request]:
        """The samples that still run, queued. A resume whose previous stream is still
        ending here supersedes it (or fails ABORTED for the router to retry)."""
        try:
            requests = convert.requests_from_pb(request, self._eos_token_ids, time.time())
            live = [r.request_id for r in requests if r.request_id in self.loop.scheduler.requests]
            if live and request.progress and not self.loop.supersede(live):
                raise ServiceError(grpc.StatusCode.ABORTED,
                                   "the request's previous stream is still ending here; retry")
            self.loop.submit(requests, sink)
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc
        return requests

    def _ended_replies(self, request: scheduler_pb2.SubmitRequest, opened: OpenRequest
                       ) -> list[scheduler_pb2.SubmitResponse]:
        """Final messages, at once, for resumed samples whose tokens already end them (the
        router lost their last message), recorded in the checkpoint."""
        replies = []
        for index, reason in convert.ended_samples(request, self._eos_token_ids):
            event = RequestEvent(RequestId(request.request_id), (), reason,
                                 len(request.prompt_token_ids))
            self.checkpointer.record(request.request_id, index, [], convert.finish_reason_to_pb(reason))
            replies.append(convert.event_to_pb(event, index, opened.with_logprobs))
        return replies

    def output(self, opened: OpenRequest, event: RequestEvent) -> scheduler_pb2.SubmitResponse:
        """One event as its message; records it in the checkpoint. The caller finishes the
        checkpoint (`finish`) before the message of the request's last sample goes out."""
        index = sample_index(event.request_id, opened.n)
        response = convert.event_to_pb(event, index, opened.with_logprobs)
        self.checkpointer.record(opened.request_id, index, list(response.token_ids),
                                 response.finish_reason)
        if event.finish_reason is not None:
            opened.unfinished.discard(event.request_id)
        return response

    async def finish(self, opened: list[OpenRequest]) -> None:
        """Requests whose every sample ended: their complete checkpoints, in one write."""
        await self.checkpointer.finish_many([o.request_id for o in opened])

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


def _original(request: scheduler_pb2.SubmitRequest) -> bytes:
    """The request as first submitted: the checkpoint keeps progress apart."""
    original = scheduler_pb2.SubmitRequest()
    original.CopyFrom(request)
    original.ClearField("progress")
    original.ClearField("trace_context")
    return original.SerializeToString()


def _samples(request: scheduler_pb2.SubmitRequest, n: int) -> list[SampleState]:
    samples = [SampleState() for _ in range(n)]
    for progress in request.progress:
        samples[progress.index] = SampleState(list(progress.token_ids), progress.finished)
    return samples
