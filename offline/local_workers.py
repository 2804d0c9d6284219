"""Tensor and pipeline parallelism for the offline `LLM`: one worker process per rank on
this machine, driven by the engine loop in the parent.

The design, and why: each rank is a spawned process that builds the same `ModelRunner` a
`worker_svc.main` worker builds (`init_distributed` on 127.0.0.1: gloo on CPU, NCCL on
CUDA, one GPU per rank) and runs each step as the worker's `ExecuteStep` does: the step's
protobuf (it crosses a process boundary) to the runner's `execute_step`, with no gRPC server, no
Redis and no
registry. The parent talks to each rank over a socket pair (a `multiprocessing`
connection), as worker_svc/local_group.py does over pipes for tests and benchmarks, but in
the step protocol of the
engine loop's `Executor` (scheduler_svc/executor.py): `LocalWorkersExecutor.execute` sends
a step to every rank in call order and collects the answers in the same order on one
thread, so with pipeline parallelism stage 0 starts step k+1 while the last stage runs k.
A full mesh group (scheduler + worker services + Redis) would give the same tokens but
needs ports, a registry and three more processes per rank; nothing here outlives `close()`.

Each rank is started as `python -m offline.local_workers FD`, not with
multiprocessing's spawn, which re-runs the caller's main module in every child: a vLLM
script without an `if __name__ == "__main__"` guard, or a notebook, works as it is.

Admin calls (`LLM.get_memory`, `get_step_stats`, `start_profile`, `stop_profile`) travel
on the same connection as the steps, so a rank answers them in its step loop, between two
steps, on the thread that runs them (torch.profiler's requirement): a message that starts
with a NUL byte is a pickled `(name, *args)` call (a protobuf message never starts with a
zero tag), an empty one means stop, anything else is a step. The parent sends a call and
queues its collection on the same reader as the steps', under one lock, so answers stay in
the order their messages went out.

Teardown: `close()` asks each rank to stop, then kills what has not exited; a
`weakref.finalize` does the same at interpreter exit (atexit) or when the group is
collected. A rank also exits when its connection to the parent breaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import socket
import subprocess
import sys
import threading
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from pagemesh.runtime.ports import reserve_port
from protos.step import ModelRunnerOutput, SchedulerOutput
from scheduler_svc import convert
from worker_svc.runner_config import RunnerConfig, RunnerInfo

START_TIMEOUT_S = 600.0  # loading a rank's shard of a large checkpoint can take minutes
STOP_TIMEOUT_S = 10.0  # for a rank to exit once asked; it is killed after that
ADMIN_PREFIX = b"\x00"  # starts an admin call's message (see the module's docstring)


class RankFailed(RuntimeError):
    """A rank failed to start or to run a step, or its process died."""


def _rank_main(
    config: RunnerConfig,
    rank: int,
    port: int,
    num_threads: int,
    dist_timeout_s: float,
    conn: Connection,
) -> None:
    """One rank: join the group, load its shard, answer `info`, then run steps until told
    to stop (or until the parent is gone)."""
    import torch

    from offline.diagnostics import RankDiagnostics
    from protos.pagemesh.worker.v1 import worker_pb2
    from worker_svc import convert as worker_convert
    from worker_svc.distributed import init_distributed
    from worker_svc.runner import ModelRunner

    if num_threads:
        torch.set_num_threads(num_threads)  # the ranks share the host's cores
    tp_size = config.parallel.tp_size
    parallel = dataclasses.replace(config.parallel, tp_rank=rank % tp_size, pp_rank=rank // tp_size)
    device = f"cuda:{rank}" if config.device.startswith("cuda") else config.device
    try:
        dist = init_distributed(
            parallel, "127.0.0.1", port, timeout_s=dist_timeout_s, device=device
        )
        runner = ModelRunner.from_config(
            dataclasses.replace(config, parallel=parallel, device=device), dist
        )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", runner.info()))
    diagnostics = RankDiagnostics(runner)  # every step recorded; the rank's profiler

    def run_step(message: bytes) -> bytes:
        request = worker_pb2.ExecuteStepRequest.FromString(message)
        output = diagnostics.run_step(worker_convert.scheduler_output_from_pb(request))
        return worker_convert.model_runner_output_to_pb(output).SerializeToString()

    try:
        while True:
            message = conn.recv_bytes()
            if not message:  # stop
                break
            if message.startswith(ADMIN_PREFIX):
                _answer_admin(diagnostics, pickle.loads(message[len(ADMIN_PREFIX) :]), conn)
                continue
            try:
                response = run_step(message)
                conn.send(("ok", response if parallel.is_driver else b""))
            except Exception as exc:  # the step failed on this rank: say so, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except (EOFError, OSError):  # the parent went away
        pass
    # Not dist.destroy(): its gloo teardown runs on a daemon thread that exiting would cut
    # short (std::terminate's message on stderr); the whole group is going away anyway.
    conn.close()
    os._exit(0)


def _answer_admin(diagnostics: Any, call: tuple[Any, ...], conn: Connection) -> None:
    """Runs an admin call; its result, or the exception it raised (for the caller)."""
    try:
        conn.send(("ok", diagnostics.answer(call)))
    except Exception as exc:
        try:
            conn.send(("raised", exc))
        except Exception:  # an exception that does not pickle: its text, then
            conn.send(("raised", RuntimeError(f"{type(exc).__name__}: {exc}")))


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
            [sys.executable, "-m", "offline.local_workers", str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            env=env,
        )
    conn = Connection(parent_end.detach())
    conn.send(args)
    return process, conn


class LocalWorkers:
    """`tp_size * pp_size` rank processes holding `config`'s model; rank = pp_rank *
    tp_size + tp_rank, the driver (the rank that samples) is tp rank 0 of the last stage.

    Raises RankFailed, after stopping every rank, when one fails to load."""

    def __init__(
        self, config: RunnerConfig, num_threads: int = 0, dist_timeout_s: float = 300.0
    ) -> None:
        parallel = config.parallel
        self.world_size = parallel.tp_size * parallel.pp_size
        self.tp_size = parallel.tp_size
        self.driver_rank = (parallel.pp_size - 1) * parallel.tp_size
        port = reserve_port()
        self._conns: list[Connection] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        for rank in range(self.world_size):
            process, conn = _start_rank((config, rank, port, num_threads, dist_timeout_s))
            self._conns.append(conn)
            self.processes.append(process)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self._conns)
        try:
            self.infos: list[RunnerInfo] = [
                self._answer(rank, START_TIMEOUT_S) for rank in range(self.world_size)
            ]
        except BaseException:
            self.close()
            raise

    def _answer(self, rank: int, timeout_s: float | None = None) -> Any:
        status, value = self._receive(rank, timeout_s)
        if status != "ok":
            raise RankFailed(f"rank {rank}: {value}")
        return value

    def _receive(self, rank: int, timeout_s: float | None = None) -> tuple[str, Any]:
        conn, process = self._conns[rank], self.processes[rank]
        while not conn.poll(1.0 if timeout_s is None else min(1.0, timeout_s)):
            if process.poll() is not None:
                raise RankFailed(f"rank {rank} exited (code {process.returncode})")
            if timeout_s is not None:
                timeout_s -= 1.0
                if timeout_s <= 0:
                    raise RankFailed(f"rank {rank} gave no answer in time")
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise RankFailed(f"rank {rank} is gone: {exc!r}") from exc

    def send_step(self, step: bytes) -> None:
        self._send(step)

    def send_admin(self, call: tuple[Any, ...]) -> None:
        """`RankDiagnostics.answer(call)` on every rank, after the steps sent before."""
        self._send(ADMIN_PREFIX + pickle.dumps(call))

    def _send(self, message: bytes) -> None:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, OSError) as exc:
                raise RankFailed(f"rank {rank} is gone: {exc!r}") from exc

    def collect_step(self) -> bytes:
        """Every rank's answer to the oldest step sent; the driver's response."""
        answers = [self._answer(rank) for rank in range(self.world_size)]
        return answers[self.driver_rank]

    def collect_admin(self) -> list[Any]:
        """Every rank's answer to the oldest admin call sent, in rank order; raises the
        first rank's exception once all have answered (the stream stays in step)."""
        answers = [self._receive(rank) for rank in range(self.world_size)]
        for rank, (status, value) in enumerate(answers):
            if status == "raised":
                raise value
            if status != "ok":
                raise RankFailed(f"rank {rank}: {value}")
        return [value for _, value in answers]

    def layout(self) -> list[tuple[int, int]]:
        """(tp_rank, pp_rank) of each rank."""
        return [(rank % self.tp_size, rank // self.tp_size) for rank in range(self.world_size)]

    def dead_ranks(self) -> list[str]:
        return [
            f"rank {r} (pid {p.pid})" for r, p in enumerate(self.processes) if p.poll() is not None
        ]

    def close(self) -> None:
        """Stops every rank; idempotent."""
        self._finalizer()


class LocalWorkersExecutor:
    """The engine loop's executor over `LocalWorkers`: steps go out as the worker's
    protobuf in call order, answers are read in the same order on one thread. Admin calls
    (`call`, from any thread) join that order: a message and its collection are queued
    under one lock (`RankAdmin` for the local workers)."""

    def __init__(self, workers: LocalWorkers) -> None:
        self.workers = workers
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ranks")
        self._broken: str | None = None
        self._send_lock = threading.Lock()  # a message and its collection, queued together

    async def execute(
        self, output: SchedulerOutput, traceparents: dict[str, str]
    ) -> ModelRunnerOutput:
        if self._broken is not None:  # answers would no longer match their steps
            raise RankFailed(self._broken)
        step = convert.scheduler_output_to_pb(output, traceparents).SerializeToString()
        with self._send_lock:
            self.workers.send_step(step)
            collected = self._reader.submit(self.workers.collect_step)
        try:
            response = await asyncio.wrap_future(collected)
        except RankFailed as exc:
            self._broken = str(exc)
            raise
        from protos.pagemesh.worker.v1 import worker_pb2

        return convert.model_runner_output_from_pb(
            worker_pb2.ExecuteStepResponse.FromString(response)
        )

    async def unresponsive(self, timeout_s: float) -> list[str]:
        return self.workers.dead_ranks()

    def layout(self) -> list[tuple[int, int]]:
        return self.workers.layout()

    def call(self, name: str, *args: Any) -> list[Any]:
        """`RankDiagnostics.<name>(*args)` on every rank, between its steps; rank order."""
        if self._broken is not None:
            raise RankFailed(self._broken)
        with self._send_lock:
            self.workers.send_admin((name, *args))
            collected = self._reader.submit(self.workers.collect_admin)
        try:
            return collected.result()
        except RankFailed as exc:  # answers would no longer match their messages
            self._broken = str(exc)
            raise

    async def close(self) -> None:
        self._reader.shutdown(wait=False)
        await asyncio.get_running_loop().run_in_executor(None, self.workers.close)


def default_num_threads(world_size: int) -> int:
    """CPU ranks share the cores: each gets its share (at least one)."""
    return max(1, (os.cpu_count() or 1) // world_size)


if __name__ == "__main__":  # a rank: `python -m offline.local_workers FD`
    _connection = Connection(int(sys.argv[1]))
    _rank_main(*_connection.recv(), _connection)
