"""What the engine loop runs its steps on: `execute(SchedulerOutput) -> ModelRunnerOutput`.

Two implementations, one loop (as vLLM's engine core runs behind its in-process and
multiprocess clients alike):
- `WorkerGroupClient` (worker_client.py): the engine group's workers over gRPC;
- `InprocExecutor` (here): a model runner in this very process, handed the step as the
  worker's own protobuf with no network in between. The runner comes from whoever builds
  the loop (bench/inprocess.py, tests), so this service still imports no torch.

Protobuf stays inside the executors, built and read by `convert.py`; the loop sees only
the step contract's types (`protos/step.py`).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from protos.step import ModelRunnerOutput, SchedulerOutput
from scheduler_svc import convert
from scheduler_svc.convert import StepFunction


class Executor(Protocol):
    async def execute(self, output: SchedulerOutput, traceparents: dict[str, str]) -> ModelRunnerOutput:
        """Runs one step; steps run in call order even when calls overlap."""

    async def unresponsive(self, timeout_s: float) -> list[str]:
        """Members that do not answer a probe within `timeout_s`, described for a log line
        (the step watchdog asks while a step runs long)."""

    async def close(self) -> None: ...


class InprocExecutor:
    """Runs each step with `run_step` (e.g. `worker_svc.inproc.step_function(runner)`) on one
    model thread, so steps keep their order and the event loop stays free to plan the next
    step (and to stream tokens out) while a forward pass runs."""

    def __init__(self, run_step: StepFunction) -> None:
        self._run_step = run_step
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def execute(self, output: SchedulerOutput, traceparents: dict[str, str]) -> ModelRunnerOutput:
        request = convert.scheduler_output_to_pb(output, traceparents)
        response = await asyncio.get_running_loop().run_in_executor(
            self._thread, self._run_step, request)
        return convert.model_runner_output_from_pb(response)

    async def unresponsive(self, timeout_s: float) -> list[str]:
        return []  # the model runs in this process: nothing to ask

    async def close(self) -> None:
        self._thread.shutdown(wait=False)
