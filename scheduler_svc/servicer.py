"""Scheduler gRPC servicer: converts, hands requests to the engine loop, streams events."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import AsyncIterator

import grpc

from pagemesh.logs import request_id_var
from pagemesh.serving import ServiceError, invalid_argument
from protos.pagemesh.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.pagemesh.v1 import generate_pb2
from scheduler_svc import convert
from scheduler_svc.core.scheduler import CapacityError
from scheduler_svc.engine_loop import EngineLoop, StepFailed

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, loop: EngineLoop, model_info: generate_pb2.GetModelInfoResponse) -> None:
        self.loop = loop
        self.model_info = model_info
        self._eos_token_ids = list(model_info.eos_token_ids)
        self._seeds = random.SystemRandom()

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        return self.model_info

    async def GetStats(self, request: scheduler_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> scheduler_pb2.GetStatsResponse:
        return convert.stats_to_pb(self.loop.scheduler.stats(), self.loop.num_steps)

    async def Submit(self, request: scheduler_pb2.SubmitRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        request_id_var.set(request.request_id)
        requests = convert.requests_from_pb(
            request, self._eos_token_ids, time.time(), self._seeds.getrandbits(63)
        )
        index_of = {r.request_id: i for i, r in enumerate(requests)}
        try:
            queue = self.loop.submit(requests)
        except CapacityError as exc:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except ValueError as exc:
            raise invalid_argument(str(exc)) from exc
        unfinished = set(index_of)
        try:
            while unfinished:
                event = await queue.get()
                if isinstance(event, StepFailed):
                    raise ServiceError(grpc.StatusCode.UNAVAILABLE, str(event))
                if event.finish_reason is not None:
                    unfinished.discard(event.request_id)
                yield convert.event_to_pb(event, index_of[event.request_id],
                                          with_logprobs=request.logprobs > 0)
        finally:
            for request_id in unfinished:  # the router cancelled or went away
                logger.info("request %s cancelled by the caller", request_id)
                self.loop.abort(request_id)
