"""Spawned processes for the worker's parallel tests (a helper, not a test).

`LocalWorkerGroup` (a whole tp x pp group playing the scheduler) lives in
`worker_svc/local_group.py`, where the benchmarks use it too; `CommRank` here holds a
bare `DistributedContext` for the tests of joining, re-forming and dead peers.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

from pagemesh.runtime.ports import reserve_port
from worker_svc.local_group import (
    ANSWER_TIMEOUT_S,
    LocalWorkerGroup,
    RankAnswer,
    RankFailed,
)

__all__ = ["CommRank", "LocalWorkerGroup", "RankAnswer", "RankFailed", "reserve_port"]


def _comm_rank_main(conn) -> None:
    import threading
    import time

    import torch

    from worker_svc.distributed import init_distributed

    torch.set_num_threads(1)
    context = None
    while True:
        command, payload = conn.recv()
        if command == "stop":
            break
        start_s = time.monotonic()
        try:
            if command in ("init", "reform"):
                parallel, port, tag, timeout_s, abort_after_s = payload
                should_abort = None
                if abort_after_s is not None:

                    def should_abort() -> bool:
                        return time.monotonic() - start_s > abort_after_s

                if command == "init":
                    context = init_distributed(
                        parallel,
                        "127.0.0.1",
                        port,
                        timeout_s=timeout_s,
                        tag=tag,
                        should_abort=should_abort,
                    )
                else:
                    context.reform(
                        "127.0.0.1", port, timeout_s, parallel, tag=tag, should_abort=should_abort
                    )
                result: Any = None
            elif command == "all_reduce":
                value, abandon_after_s = payload
                if abandon_after_s is not None:  # as the servicer does when the group re-forms
                    threading.Timer(abandon_after_s, context.abandon).start()
                tensor = torch.full((4,), float(value))
                result = context.tp_all_reduce(tensor).tolist()
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(RankAnswer(-1, (result, time.monotonic() - start_s)))
        except Exception as exc:  # report, keep serving: the test decides what comes next
            conn.send(
                RankAnswer(-1, (None, time.monotonic() - start_s), type(exc).__name__, str(exc))
            )
    if context is not None:
        context.destroy()
    conn.close()


class CommRank:
    """One spawned process holding a bare `DistributedContext` (no model), for tests of
    joining, re-forming and dead peers. Each command answers (result, seconds it took)."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self.process = context.Process(target=_comm_rank_main, args=(child_end,), daemon=True)
        self.process.start()
        child_end.close()

    def init(
        self,
        parallel: Any,
        port: int,
        tag: str = "",
        timeout_s: float = 30.0,
        abort_after_s: float | None = None,
    ) -> None:
        self._conn.send(("init", (parallel, port, tag, timeout_s, abort_after_s)))

    def reform(
        self,
        port: int,
        tag: str = "",
        timeout_s: float = 30.0,
        parallel: Any = None,
        abort_after_s: float | None = None,
    ) -> None:
        self._conn.send(("reform", (parallel, port, tag, timeout_s, abort_after_s)))

    def all_reduce(self, value: float, abandon_after_s: float | None = None) -> None:
        """Sum `[value] * 4` over the rank's TP group; with `abandon_after_s`, another thread
        of the rank abandons the group that long after the op started."""
        self._conn.send(("all_reduce", (value, abandon_after_s)))

    def answer(self, timeout_s: float = ANSWER_TIMEOUT_S) -> RankAnswer:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"no answer within {timeout_s} s")
        return self._conn.recv()

    def answer_ok(self, timeout_s: float = ANSWER_TIMEOUT_S) -> Any:
        answer = self.answer(timeout_s)
        if not answer.ok:
            raise RankFailed(f"{answer.error_type}: {answer.message}")
        return answer.value[0]

    def kill(self) -> None:
        """SIGKILL: no clean-up, as when a worker dies."""
        self.process.kill()
        self.process.join(timeout=10)

    def close(self) -> None:
        try:
            self._conn.send(("stop", None))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
