"""The one way tests wait for something another process or task does: poll a predicate.

A test never sleeps a fixed time before an assert (too short on a loaded 2-core CI machine,
too long everywhere else); it waits until the state it asserts is there, or fails with a
message that says what did not happen, within a timeout generous enough for CI.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
Message = str | Callable[[], str]


def eventually(
    predicate: Callable[[], T],
    timeout_s: float,
    what: Message = "condition",
    interval_s: float = 0.1,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Calls `predicate` until it returns a truthy value and returns that value. A call that
    raises one of `ignoring` (say, `grpc.RpcError` while a server starts) counts as not yet.
    After `timeout_s` it fails with `what` (or `what()`, e.g. a process's log tail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignoring:
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_text(what)}: not within {timeout_s} s")
        time.sleep(interval_s)


async def eventually_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout_s: float = 5.0,
    what: Message = "condition",
    interval_s: float = 0.02,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """`eventually` inside an event loop: `predicate` may be a coroutine function, and the
    loop keeps running the tasks that are to make it true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        try:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
        except ignoring:
            pass
        if loop.time() >= deadline:
            raise AssertionError(f"{_text(what)}: not within {timeout_s} s")
        await asyncio.sleep(interval_s)


def _text(what: Message) -> str:
    return what() if callable(what) else what
