"""Tensor and pipeline parallelism for the offline `LLM`: one worker process per rank on
this machine, driven by the engine loop in the parent.

The design, and why: each rank is a spawned process that builds the same `ModelRunner` a
`worker_svc.main` worker builds (`init_distributed` on 127.0.0.1: gloo on CPU, NCCL on
CUDA, one GPU per rank) and runs each step with `worker_svc.inproc.step_function`: the
worker's `ExecuteStep` on the step's protobuf, with no gRPC server, no Redis and no
registry. The parent talks to each rank over a socket pair (a `multiprocessing`
connection), as worker_svc/local_group.py does over pipes for tests and benchmarks, but in
the step protocol of the
engine loop's `Executor` (scheduler_svc/executor.py): `LocalWorkersExecutor.execute` sends
a step to every rank in call order and collects the answers in the same order on one
thread, so with pipeline parallelism stage 0 starts step k+1 while the last stage runs k.
A full mesh group (scheduler + worker services + Redis) would give the same tokens but
needs ports, a registry and three more processes per rank; nothing here outlives `close()`.

Each rank is started as `python -m pagemesh.offline.local_workers FD`, not with
multiprocessing's spawn, which re-runs the caller's main module in every child: a vLLM
script without an `if __name__ == "__main__"` guard, or a notebook, works as it is.

Teardown: `close()` asks each rank to stop, then kills what has not exited; a
`weakref.finalize` does the same at interpreter exit (atexit) or when the group is
collected. A rank also exits when its connection to the parent breaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from pagemesh.mesh_process import free_port
from protos.step import ModelRunnerOutput, SchedulerOutput
from scheduler_svc import convert
from worker_svc.runner import RunnerConfig, RunnerInfo

START_TIMEOUT_S = 600.0  # loading a rank's shard of a large checkpoint can take minutes
STOP_TIMEOUT_S = 10.0  # for a rank to exit once asked; it is killed after that


class RankFailed(RuntimeError):
    """A rank failed to start or to run a step, or its process died."""


def _rank_main(config: RunnerConfig, rank: int, port: int, num_threads: int,
               dist_timeout_s: float, conn: Connection) -> None:
    """One rank: join the group, load its shard, answer `info`, then run steps until told
    to stop (or until the parent is gone)."""
    import torch

    from protos.pagemesh.worker.v1 import worker_pb2
    from worker_svc.distributed import init_distributed
    from worker_svc.inproc import step_function
    from worker_svc.runner import ModelRunner

    if num_threads:
        torch.set_num_threads(num_threads)  # the ranks share the host's cores
    tp_size = config.parallel.tp_size
    parallel = dataclasses.replace(config.parallel, tp_rank=rank % tp_size,
                                   pp_rank=rank // tp_size)
    device = f"cuda:{rank}" if config.device.startswith("cuda") else config.device
    try:
        dist = init_distributed(parallel, "127.0.0.1", port, timeout_s=dist_timeout_s,
                                device=device)
        runner = ModelRunner.from_config(
            dataclasses.replace(config, parallel=parallel, device=device), dist)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", runner.info()))
    run_step = step_function(runner)
    try:
        while True:
            message = conn.recv_bytes()
            if not message:  # stop
                break
            try:
                response = run_step(worker_pb2.ExecuteStepRequest.FromString(message))
                conn.send(("ok", response.SerializeToString() if parallel.is_driver else b""))
            except Exception as exc:  # the step failed on this rank: say so, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):  # the parent went away
        pass
    # Not dist.destroy(): its gloo teardown runs on a daemon thread that exiting would cut
    # short (std::terminate's message on stderr); the whole group is going away anyway.
    conn.close()
    os._exit(0)


def _stop(processes: list[subprocess.Popen[bytes]], conns: list[Connection]) -> None:
    """Asks every rank to stop, then kills the ones still running (also at exit)."""
    for conn in conns:
        try:
            conn.send_bytes(b"")
        except (BrokenPipeError, OSError):
            pass
    for process in processes:
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()


def _start_rank(args: tuple[Any, ...]) -> tuple[subprocess.Popen[bytes], Connection]:
    """A rank process running `_rank_main(*args, conn)`, and the parent's end of `conn`."""
    parent_end, child_end = socket.socketpair()
    # The child imports what this process imports, from where it imports it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    with child_end:
        process = subprocess.Popen(
            [sys.executable, "-m", "pagemesh.offline.local_workers", str(child_end.fileno())],
            pass_fds=[child_end.fileno()], env=env)
    conn = Connection(parent_end.detach())
    conn.send(args)
    return process, conn


class LocalWorkers:
    """`tp_size * pp_size` rank processes holding `config`'s model; rank = pp_rank *
    tp_size + tp_rank, the driver (the rank that samples) is tp rank 0 of the last stage.

    Raises RankFailed, after stopping every rank, when one fails to load."""

    def __init__(self, config: RunnerConfig, num_threads: int = 0,
                 dist_timeout_s: float = 300.0) -> None:
        parallel = config.parallel
        self.world_size = parallel.tp_size * parallel.pp_size
        self.driver_rank = (parallel.pp_size - 1) * parallel.tp_size
        port = free_port()
        self._conns: list[Connection] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(self.world_size):
            process, conn = _start_rank((config, rank, port, num_threads, dist_timeout_s))
            self._conns.append(conn)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)
        try:
            self.infos: list[RunnerInfo] = [self._answer(rank, START_TIMEOUT_S)
                                            for rank in range(self.world_size)]
        except BaseException:
            self.close()
            raise

    def _answer(self, rank: int, timeout_s: float | None = None) -> Any:
        conn, process = self._conns[rank], self.processes[rank]
        while not conn.poll(1.0 if timeout_s is None else min(1.0, timeout_s)):
            if process.poll() is not None:
                raise RankFailed(f"rank {rank} exited (code {process.returncode})")
            if timeout_s is not None:
                timeout_s -= 1.0
                if timeout_s <= 0:
                    raise RankFailed(f"rank {rank} gave no answer in time")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailed(f"rank {rank} is gone: {exc!r}") from exc
        if status != "ok":
            raise RankFailed(f"rank {rank}: {value}")
        return value

    def send_step(self, step: bytes) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(step)
            except (BrokenPipeError, OSError) as exc:
                raise RankFailed(f"rank {rank} is gone: {exc!r}") from exc

    def collect_step(self) -> bytes:
        """Every rank's answer to the oldest step sent; the driver's response."""
        answers = [self._answer(rank) for rank in range(self.world_size)]
        return answers[self.driver_rank]

    def dead_ranks(self) -> list[str]:
        return [f"rank {r} (pid {p.pid})" for r, p in enumerate(self.processes)
                if p.poll() is not None]

    def close(self) -> None:
        """Stops every rank; idempotent."""
        self._finalizer()


class LocalWorkersExecutor:
    """The engine loop's executor over `LocalWorkers`: steps go out as the worker's
    protobuf in call order, answers are read in the same order on one thread."""

    def __init__(self, workers: LocalWorkers) -> None:
        self.workers = workers
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranks")
        self._broken: str | None = None

    async def execute(self, output: SchedulerOutput, traceparents: dict[str, str]
                      ) -> ModelRunnerOutput:
        if self._broken is not None:  # answers would no longer match their steps
            raise RankFailed(self._broken)
        self.workers.send_step(convert.scheduler_output_to_pb(output, traceparents)
                               .SerializeToString())
        try:
            response = await asyncio.get_running_loop().run_in_executor(
                self._reader, self.workers.collect_step)
        except RankFailed as exc:
            self._broken = str(exc)
            raise
        from protos.pagemesh.worker.v1 import worker_pb2

        return convert.model_runner_output_from_pb(
            worker_pb2.ExecuteStepResponse.FromString(response))

    async def unresponsive(self, timeout_s: float) -> list[str]:
        return self.workers.dead_ranks()

    async def close(self) -> None:
        self._reader.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self.workers.close)


def default_num_threads(world_size: int) -> int:
    """CPU ranks share the cores: each gets its share (at least one)."""
    return max(1, (os.cpu_count() or 1) // world_size)


if __name__ == "__main__":  # a rank: `python -m pagemesh.offline.local_workers FD`
    _connection = Connection(int(sys.argv[1]))
    _rank_main(*_connection.recv(), _connection)
