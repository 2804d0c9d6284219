"""Hostile input by volume through a live mesh (issue 21), at a small size: bench/fuzz's own
run (its mesh: `pagemesh up` on a tiny model with gRPC and HTTP) with 300 requests of every
kind — fuzzed GenerateRequest fields and OpenAI bodies, malformed bytes, an oversized
message, slow clients, a disconnect storm — while a gRPC and an HTTP client send known
greedy requests. `python -m bench.fuzz` runs the same at 10,000."""

from __future__ import annotations

from pathlib import Path

from bench.fuzz import outcomes as oc
from bench.fuzz import report
from bench.fuzz.__main__ import run
from bench.fuzz.plan import KINDS
from bench.fuzz.run import FuzzConfig
from pagemesh.tools.loadgen.machine import machine_record

NUM_REQUESTS = 300


def test_hostile_input_leaves_the_mesh_up_every_block_free_and_good_clients_served(
    tmp_path: Path,
) -> None:
    result = run(
        FuzzConfig(
            num_requests=NUM_REQUESTS,
            seed=0,
            concurrency=16,
            deadline_s=60.0,
            settle_s=30.0,
            quiet=True,
        ),
        workdir=tmp_path,
    )
    text = report.markdown(result, "tests/e2e/test_fuzz.py", machine_record())
    print(text)
    classes = report.counts(result)["total"]
    assert len(result.outcomes) >= NUM_REQUESTS
    assert {o.kind for o in result.outcomes} == set(KINDS), text
    assert not result.died, text
    for failure in (
        oc.HUNG,
        oc.SERVER_ERROR,
        oc.UNAVAILABLE,
        oc.UNCLEAR,
        oc.MALFORMED,
        oc.FUZZER_ERROR,
    ):
        assert not classes[failure], f"{classes[failure]} {failure}:\n{text}"
    assert result.settled_after_s is not None and not result.blocks_leaked, text
    assert all(g.num_requests and not g.num_failures for g in result.good), text
    assert result.audit and all(row.passed for row in result.audit), text
    assert classes[oc.OK] and classes[oc.REFUSED] and classes[oc.CANCELLED]  # each path was taken
