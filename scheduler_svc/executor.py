"""What the engine loop runs its steps on: `execute(SchedulerOutput) -> ModelRunnerOutput`.

Two implementations, one loop (as vLLM's engine core runs behind its in-process and
multiprocess clients alike):
- `WorkerGroupClient` (worker_client.py): the engine group's workers over gRPC;
- `InprocExecutor` (here): a model runner in this very process, called with the step
  contract's own types (`runner.execute_step`): no protobuf, as vLLM's in-process client
  calls its engine core directly. The runner comes from whoever builds the loop
  (bench/inprocess.py, the offline LLM, tests), so this service still imports no torch.

Protobuf appears only where a step crosses a process boundary (the gRPC executor here, the
offline LLM's local worker processes), built and read by `convert/`; the loop sees only
the step contract's types (`protos/step.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from protos.step import ModelRunnerOutput, SchedulerOutput

# What an in-process executor runs: a model runner's `execute_step`, or one around it.
StepFunction = Callable[[SchedulerOutput], ModelRunnerOutput]


class Executor(Protocol):
    async def execute(
        self, output: SchedulerOutput, traceparents: dict[str, str]
    ) -> ModelRunnerOutput:
        """Runs one step; steps run in call order even when calls overlap."""

    async def unresponsive(self, timeout_s: float) -> list[str]:
        """Members that do not answer a probe within `timeout_s`, described for a log line
        (the step watchdog asks while a step runs long)."""

    async def close(self) -> None: ...


def model_thread() -> ThreadPoolExecutor:
    """The one thread a model's torch work runs on in this process: its loading and its
    steps alike. Two threads calling into OpenMP make two thread teams, and on a 2-core
    machine a SmolLM2 decode step run from the second thread measured clearly slower than on
    the first (`python -m bench.omp_threads`)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")


class InprocExecutor:
    """Runs each step with `run_step` (e.g. `runner.execute_step`) on one model thread, so
    steps keep their order and the event loop stays free to plan the next step (and to
    stream tokens out) while a forward pass runs. The runner copies what it keeps of a step
    (token and block lists), so the scheduler may go on changing its requests meanwhile."""

    def __init__(
        self,
        run_step: StepFunction,
        thread: ThreadPoolExecutor | None = None,
        close_thread: bool = True,
    ) -> None:
        """`thread`: the `model_thread()` the runner was loaded on (a new one if None);
        `close_thread` False leaves it running after `close()` (another executor's next)."""
        self._run_step = run_step
        self._close_thread = close_thread
        self._thread = thread or model_thread()

    async def execute(
        self, output: SchedulerOutput, traceparents: dict[str, str]
    ) -> ModelRunnerOutput:
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, self._run_step, output
        )

    async def unresponsive(self, timeout_s: float) -> list[str]:
        return []  # the model runs in this process: nothing to ask

    async def close(self) -> None:
        if self._close_thread:
            self._thread.shutdown(wait=False)
