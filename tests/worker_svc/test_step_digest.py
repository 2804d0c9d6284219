"""The step digest ranks compare before they run a step (worker_svc/batch.step_digest): the
same step digests the same in any process, and a step that would run differently (another
adapter, other tokens or blocks) digests differently."""

from __future__ import annotations

import subprocess
import sys

from protos.step import LoraRef, NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.batch import step_digest


def step(
    lora: LoraRef | None = None, tokens: tuple[int, ...] = (5, 6, 7), blocks: tuple[int, ...] = (0,)
) -> SchedulerOutput:
    new = NewRequestData(
        "r", list(tokens), len(tokens), list(blocks), 0, SamplingParams(temperature=0.0), lora=lora
    )
    return SchedulerOutput(3, new_requests=[new], num_scheduled_tokens={"r": len(tokens)})


def test_a_step_that_would_run_differently_digests_differently() -> None:
    base = step_digest(step())
    assert step_digest(step()) == base
    variants = [
        step(LoraRef("sql", "/a/sql")),
        step(LoraRef("sql", "/b/sql")),
        step(LoraRef("chat", "/a/sql")),
        step(tokens=(5, 6, 8)),
        step(blocks=(1,)),
    ]
    digests = [step_digest(s) for s in variants]
    assert base not in digests and len(set(digests)) == len(digests)


def test_the_digest_is_the_same_in_another_process() -> None:
    code = (
        "from tests.worker_svc.test_step_digest import step; from protos.step import "
        "LoraRef; from worker_svc.batch import step_digest; "
        "print(step_digest(step(LoraRef('sql', '/a/sql'))))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert int(other) == step_digest(step(LoraRef("sql", "/a/sql")))
