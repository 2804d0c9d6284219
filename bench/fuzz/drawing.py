"""Hypothesis strategies drawn one value at a time from a seed, outside any test.

Hypothesis draws through a `ConjectureData` whose choices come from a `random.Random`; here
each value gets its own, seeded by (run seed, request index), so request i of seed s is the
same whatever ran before it and can be drawn again alone (`--only`). This reaches two of
Hypothesis's internals (`ConjectureData`, `BuildContext`), public in all but name since
Hypothesis 6.100; `tests/bench/test_fuzz_drawing.py` fails if an upgrade moves them.
"""

from __future__ import annotations

import random
from typing import TypeVar

from hypothesis.control import BuildContext
from hypothesis.errors import StopTest, UnsatisfiedAssumption
from hypothesis.internal.conjecture.data import ConjectureData
from hypothesis.strategies import SearchStrategy

T = TypeVar("T")

MAX_ATTEMPTS = 16  # draws that overran Hypothesis's size budget (or failed a filter) are redrawn


def draw(strategy: SearchStrategy[T], seed: int, index: int) -> T:
    """The value of `strategy` for (`seed`, `index`): the same in every run and process."""
    for attempt in range(MAX_ATTEMPTS):
        data = ConjectureData(random=random.Random(f"{seed}:{index}:{attempt}"))
        try:
            with BuildContext(data, wrapped_test=None, is_final=False):
                return data.draw(strategy)
        except (StopTest, UnsatisfiedAssumption):
            continue
    raise RuntimeError(
        f"no value of {strategy!r} for seed {seed}, index {index} in {MAX_ATTEMPTS} attempts"
    )
