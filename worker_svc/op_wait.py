"""Waiting for a torch.distributed op in a way another thread can call off.

A frozen or cut-off peer closes no socket, so an op waiting on it ends only at the group's
timeout. When the scheduler has declared that peer failed, the rank must stop waiting at
once and re-form (`abandon`). gloo offers no call that ends an op in progress, so the waits
are cut into slices:

- collectives (all-reduce, all-gather): `work.wait(timeout=slice)`; a slice that ends leaves
  the op pending and untouched, so it is simply waited on again;
- point-to-point (a pipeline stage's send and receive): gloo fails the op when a timed wait
  ends, and its completion cannot be polled, so they are waited on by a daemon thread of
  their own, and the caller waits for that thread in slices. An abandoned wait leaves that
  thread blocked on the old group's op (until the op's own timeout); the next op gets a
  new thread.

Between two slices the caller gives up once `abandon` was called.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta

import torch.distributed as dist

SLICE_S = 0.2


class _Waited(threading.Event):
    """Set when the waiter thread is done with one op; `error` is what its wait raised."""

    error: BaseException | None = None


class _P2PWaiter:
    """One daemon thread that waits for the point-to-point ops handed to it, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[dist.Work, _Waited]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="p2p-wait", daemon=True).start()

    def submit(self, work: dist.Work) -> _Waited:
        waited = _Waited()
        self._queue.put((work, waited))
        return waited

    def _run(self) -> None:
        while True:
            work, waited = self._queue.get()
            try:
                work.wait()
            except BaseException as exc:  # handed back to the caller's thread
                waited.error = exc
            waited.set()


class OpWaiter:
    """Waits for one rank's ops until they end or `abandon()` is called (from any thread)."""

    def __init__(self) -> None:
        self._abandoned = threading.Event()
        self._p2p: _P2PWaiter | None = None

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    def abandon(self) -> None:
        self._abandoned.set()

    def reset(self) -> None:
        """A new group was joined: its ops are waited on again."""
        self._abandoned.clear()

    def wait(self, work: dist.Work, p2p: bool) -> bool:
        """Whether `work` ended (False: abandoned first). Raises the op's own error (a lost
        peer, the group's timeout) as torch raised it."""
        if p2p:
            return self._wait_p2p(work)
        while True:
            try:
                work.wait(timeout=timedelta(seconds=SLICE_S))
                return True
            except RuntimeError:
                if work.is_completed():  # failed, not merely still running
                    raise
            if self._abandoned.is_set():
                return False

    def _wait_p2p(self, work: dist.Work) -> bool:
        if self._p2p is None:
            self._p2p = _P2PWaiter()
        waited = self._p2p.submit(work)
        while not waited.wait(SLICE_S):
            if self._abandoned.is_set():
                self._p2p = None  # its thread is stuck on this op: the next one gets another
                return False
        if waited.error is not None:
            raise waited.error
        return True
