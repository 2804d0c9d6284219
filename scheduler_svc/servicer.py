"""Scheduler gRPC servicer: converts, hands requests to the engine loop, streams events,
keeps each request's checkpoint current."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator

import grpc

from pagemesh.checkpoints import SampleState
from pagemesh.logs import request_id_var
from pagemesh.serving import ServiceError, invalid_argument
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from scheduler_svc import convert
from scheduler_svc.checkpoint import Checkpointer
from scheduler_svc.core.scheduler import CapacityError
from scheduler_svc.core.types import RequestEvent, RequestId
from scheduler_svc.engine_loop import DRAINING, EngineLoop, StepFailed

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop, model_info: generate_pb2.GetModelInfoResponse,
                 checkpointer: Checkpointer | None = None) -> None:
        self.loop = loop
        self.model_info = model_info
        self.checkpointer = checkpointer or Checkpointer(None, "", 0, 0.0)
        self._eos_token_ids = list(model_info.eos_token_ids)
        self._seeds = random.SystemRandom()

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        return self.model_info

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.GetStatsResponse:
        loop = self.loop
        return convert.stats_to_pb(loop.scheduler.stats(), loop.num_steps, loop.status,
                                   loop.num_recoveries)

    async def Submit(self, request: scheduler_pb2.SubmitRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        request_id_var.set(request.request_id)
        if self.loop.status == DRAINING:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE,
                               "this scheduler is draining; send the request to another group")
        try:
            requests = convert.requests_from_pb(
                request, self._eos_token_ids, time.time(), self._seeds.getrandbits(63)
            )
            live = [r.request_id for r in requests if r.request_id in self.loop.scheduler.requests]
            if live and request.progress and not self.loop.supersede(live):
                raise ServiceError(grpc.StatusCode.ABORTED,
                                   "the request's previous stream is still ending here; retry")
            queue = self.loop.submit(requests)
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc
        n = max(request.n, 1)
        if request.progress:
            logger.info("resuming request %s after %s tokens", request.request_id,
                        [len(p.token_ids) for p in request.progress])
        self.checkpointer.track(request.request_id, _original(request), _samples(request, n))
        unfinished = {r.request_id for r in requests}
        for index, reason in convert.ended_samples(request, self._eos_token_ids):
            event = RequestEvent(RequestId(request.request_id), (), reason,
                                 len(request.prompt_token_ids))
            self.checkpointer.record(request.request_id, index, [], convert.finish_reason_to_pb(reason))
            yield convert.event_to_pb(event, index, with_logprobs=False)
        if not unfinished:
            await self.checkpointer.finish(request.request_id)
        request_trace = self.loop.tracing.start(request.request_id, requests,
                                                len(request.prompt_token_ids), bool(request.progress))
        try:
            while unfinished:
                event = await queue.get()
                if isinstance(event, StepFailed):
                    self.loop.tracing.fail(request_trace, str(event))
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(event))
                index = convert.sample_index(event.request_id, n)
                response = convert.event_to_pb(event, index, with_logprobs=request.logprobs > 0)
                self.checkpointer.record(request.request_id, index, list(response.token_ids),
                                         response.finish_reason)
                if event.finish_reason is not None:
                    unfinished.discard(event.request_id)
                    if not unfinished:  # the record is complete before the last message leaves
                        await self.checkpointer.finish(request.request_id)
                yield response
        finally:
            if unfinished:  # the router cancelled or went away, or this group gave up
                logger.info("request %s left unfinished", request.request_id)
                self.checkpointer.orphan(request.request_id)
                for request_id in unfinished:
                    self.loop.abort(request_id)
            self.loop.tracing.end(request_trace)


def _original(request: scheduler_pb2.SubmitRequest) -> bytes:
    """The request as first submitted: the checkpoint keeps progress apart."""
    original = scheduler_pb2.SubmitRequest()
    original.CopyFrom(request)
    original.ClearField("progress")
    return original.SerializeToString()


def _samples(request: scheduler_pb2.SubmitRequest, n: int) -> list[SampleState]:
    samples = [SampleState() for _ in range(n)]
    for progress in request.progress:
        samples[progress.index] = SampleState(list(progress.token_ids), progress.finished)
    return samples
