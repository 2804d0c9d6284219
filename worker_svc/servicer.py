"""Worker gRPC servicer: converts, runs the step on the model thread, converts back."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from pagemesh.serving import ServiceError
from protos.pagemesh.worker.v1 import worker_pb2, worker_pb2_grpc
from worker_svc import convert
from worker_svc.runner import ModelRunner

logger = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, worker_id: str, layout: dict[str, int]) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.layout = layout
        # One thread owns the model: steps run strictly one after another, and the event
        # loop stays free for health checks while a forward pass runs.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.num_steps = 0

    async def GetWorkerInfo(self, request: worker_pb2.GetWorkerInfoRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.GetWorkerInfoResponse:
        return convert.worker_info_to_pb(self.runner.info(), self.worker_id, self.layout)

    async def ExecuteStep(self, request: worker_pb2.ExecuteStepRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.ExecuteStepResponse:
        step = convert.step_input_from_pb(request)
        loop = asyncio.get_running_loop()
        try:
            output = await loop.run_in_executor(self._executor, self.runner.execute_step, step)
        except ValueError as exc:  # an inconsistent step plan: the scheduler's bug, said plainly
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from exc
        self.num_steps += 1
        return convert.step_output_to_pb(output)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
