"""A model runner as a step function on protobuf, for an engine loop in the same process
(scheduler_svc/executor.py's `InprocExecutor`): what `ExecuteStep` does, with no server."""

from __future__ import annotations

from collections.abc import Callable

from protos.pagemesh.worker.v1 import worker_pb2
from worker_svc import convert
from worker_svc.runner import ModelRunner


def step_function(runner: ModelRunner
                  ) -> Callable[[worker_pb2.ExecuteStepRequest], worker_pb2.ExecuteStepResponse]:
    def run_step(request: worker_pb2.ExecuteStepRequest) -> worker_pb2.ExecuteStepResponse:
        return convert.model_runner_output_to_pb(runner.execute_step(convert.scheduler_output_from_pb(request)))

    return run_step
