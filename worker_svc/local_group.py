"""A group of worker processes driven from one parent, with no scheduler (benchmarks, tests).

`LocalWorkerGroup(tp_size, pp_size)` starts `tp_size * pp_size` worker processes on 127.0.0.1
that join one gloo process group, as the worker mains of a real group do. The parent
plays the scheduler: it sends the same `SchedulerOutput` to every rank over a pipe, each rank
runs it on its own `ModelRunner`, and the parent collects every rank's answer (the
driver's tokens, or the exception each rank raised). A group outlives a model: `load`
builds fresh runners (any model, any layer split) in the same processes.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import traceback
from dataclasses import dataclass
from typing import Any

from pagemesh.runtime.ports import reserve_port
from protos.step import ModelRunnerOutput, SchedulerOutput
from worker_svc.runner_config import RunnerConfig, RunnerInfo

GROUP_TIMEOUT_S = 60.0  # torch.distributed's bound on any collective or receive
ANSWER_TIMEOUT_S = 45.0  # how long the parent waits for one rank's answer


@dataclass(frozen=True)
class RankAnswer:
    rank: int
    value: Any = None  # the command's result when it succeeded
    error_type: str | None = None  # the exception's class name when it failed
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.error_type is None


class RankFailed(RuntimeError):
    pass


def read_memory_kib() -> dict[str, int]:
    """VmHWM (peak resident), VmRSS and RssAnon of this process, KiB, from /proc."""
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon"):
                values[key] = int(rest.split()[0])
    return values


def _rank_main(tp_size: int, pp_size: int, rank: int, port: int, conn, num_threads: int) -> None:
    import torch

    from worker_svc.distributed import init_distributed
    from worker_svc.model.expert_balance import expert_parallel_blocks
    from worker_svc.parallel import ParallelConfig
    from worker_svc.runner import ModelRunner

    torch.set_num_threads(num_threads)  # ranks share the host's cores
    parallel = ParallelConfig(tp_size, rank % tp_size, pp_size, rank // tp_size)
    dist = init_distributed(parallel, "127.0.0.1", port, timeout_s=GROUP_TIMEOUT_S)
    runner = None
    memory_before_load: dict[str, int] = {}
    while True:
        command, payload = conn.recv()
        if command == "stop":
            break
        try:
            if command == "load":
                config, layer_split = payload
                memory_before_load = read_memory_kib()
                config = dataclasses.replace(
                    config,
                    parallel=dataclasses.replace(
                        parallel,
                        pp_layer_split=layer_split,
                        expert_parallel=config.parallel.expert_parallel,
                    ),
                )
                runner = ModelRunner.from_config(config, dist)
                result: Any = runner.info()
            elif command == "step":
                result = runner.execute_step(payload)
            elif command == "memory":
                result = {"before_load": memory_before_load, "now": read_memory_kib()}
            elif command == "placements":  # expert parallelism: layer -> expert ids held
                result = {
                    block.layer_index: block.experts.global_ids
                    for block in expert_parallel_blocks(runner.model)
                }
            elif command == "shapes":
                result = {n: tuple(p.shape) for n, p in runner.model.named_parameters()}
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(RankAnswer(rank, result))
        except Exception as exc:  # report, keep serving: the group must stay usable
            conn.send(
                RankAnswer(rank, None, type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
            )
    dist.destroy()
    conn.close()


class LocalWorkerGroup:
    """tp_size x pp_size ranks in spawned processes; rank = pp_rank * tp_size + tp_rank."""

    def __init__(self, tp_size: int, pp_size: int, num_threads: int = 1) -> None:
        self.tp_size, self.pp_size = tp_size, pp_size
        self.world_size = tp_size * pp_size
        self.infos: list[RunnerInfo] = []
        context = multiprocessing.get_context("spawn")
        port = reserve_port()
        self._conns, self._processes = [], []
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_rank_main,
                args=(tp_size, pp_size, rank, port, child_end, num_threads),
                daemon=True,
                name=f"rank{rank}",
            )
            process.start()
            child_end.close()
            self._conns.append(parent_end)
            self._processes.append(process)

    @property
    def driver_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    @property
    def num_blocks(self) -> int:
        """What the scheduler would use: the minimum over ranks."""
        return min(info.num_blocks for info in self.infos)

    def send(self, command: str, payloads: Any | list[Any]) -> None:
        """Send `command` to every rank; a list gives each rank its own payload."""
        if not isinstance(payloads, list):
            payloads = [payloads] * self.world_size
        for conn, payload in zip(self._conns, payloads, strict=True):
            conn.send((command, payload))

    def collect(self, timeout_s: float = ANSWER_TIMEOUT_S) -> list[RankAnswer]:
        """One answer from every rank, in rank order; raises if one is silent (a hang)."""
        answers = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(timeout_s):
                raise TimeoutError(f"rank {rank} gave no answer within {timeout_s} s")
            answers.append(conn.recv())
        return answers

    def call(self, command: str, payloads: Any | list[Any] = None) -> list[RankAnswer]:
        self.send(command, payloads)
        return self.collect()

    def call_ok(self, command: str, payloads: Any | list[Any] = None) -> list[Any]:
        answers = self.call(command, payloads)
        failed = [a for a in answers if not a.ok]
        if failed:
            raise RankFailed(f"rank {failed[0].rank}: {failed[0].error_type}: {failed[0].message}")
        return [a.value for a in answers]

    def load(
        self, config: RunnerConfig, layer_split: tuple[int, ...] | None = None
    ) -> list[RunnerInfo]:
        self.infos = self.call_ok("load", (config, layer_split))
        return self.infos

    def execute_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Like `ModelRunner.execute_step` for the whole group: the driver's output."""
        outputs = self.call_ok("step", step)
        assert all(not o.sampled for r, o in enumerate(outputs) if r != self.driver_rank)
        return outputs[self.driver_rank]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    def __enter__(self) -> LocalWorkerGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
