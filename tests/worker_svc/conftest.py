"""Fixtures of the worker tests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kernels import cpu_native


@pytest.fixture
def native_kernels() -> Iterator[Callable[..., None]]:
    """`native_kernels(enabled=False)` installs the C kernels' config (`cpu_native.configure`)
    with those fields changed, for one test; the config before it comes back after."""
    previous = cpu_native.current_config()

    def install(**changes: Any) -> None:
        cpu_native.configure(dataclasses.replace(previous, **changes))

    yield install
    cpu_native.configure(previous)
