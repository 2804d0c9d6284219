"""The fault matrix (bench/fault_matrix.py) at a small size: 32 concurrent streams per
scenario, every process of the mesh killed, frozen or cut off mid-stream. Nothing may fail,
every stream must equal its undisturbed run (tokens, and logprobs within 1e-4; a quarter of
them seeded samples), and a frozen or cut-off process must be noticed within 10 s and got
over within 20 s. Real processes, real signals, real network namespaces."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bench.fault_matrix import run_scenario, select, start_target, target_plan, wait_ready
from bench.faults.scenarios import Scenario
from bench.faults.targets import Target, write_model
from bench.faults.workload import Clients, RequestResult
from protos.pagemesh.v1 import generate_pb2

NUM_CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS = 32, 1, 32
HANG_DETECT_S, HANG_RECOVER_S = 10.0, 20.0  # the targets, on this machine
SCENARIOS = select(None)


class OneTargetAtATime:
    """The scenarios' meshes, started as the parametrized tests reach them; one at a time
    (two idle meshes on two cores would slow each other's recoveries)."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model, self.log_dir = model, log_dir
        self.target: Target | None = None
        self.clients: Clients | None = None
        self.calm: list[RequestResult] = []

    def get(self, name: str) -> tuple[Target, Clients, list[RequestResult]]:
        if self.target is None or self.target.name != name:
            self.close()
            self.target = start_target(name, self.model, self.log_dir)
            self.clients = Clients(self.target.address)
            wait_ready(self.target)
            self.calm = self.clients.run(
                target_plan(self.target, NUM_CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS, "calm")
            ).results
            assert not [r.error for r in self.calm if r.error], "the undisturbed run failed"
        assert self.clients is not None
        return self.target, self.clients, self.calm

    def close(self) -> None:
        if self.clients is not None:
            self.clients.close()
        if self.target is not None:
            self.target.stop()
        self.target = self.clients = None


@pytest.fixture(scope="module")
def meshes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneTargetAtATime]:
    pool = OneTargetAtATime(
        write_model(tmp_path_factory.mktemp("fm-model") / "tiny"),
        tmp_path_factory.mktemp("fm-logs"),
    )
    try:
        yield pool
    finally:
        pool.close()


# First, on the first mesh the scenarios use (`single`), so it is started once.


def test_a_seed_gives_the_same_tokens_alone_as_among_32_streams(meshes: OneTargetAtATime) -> None:
    target, clients, calm = meshes.get("single")
    seeded = [r for r in calm if r.spec.seed is not None]
    assert len(seeded) == NUM_CLIENTS // 4
    for batched in seeded[:4]:
        spec = dataclasses.replace(batched.spec, request_id=f"alone-{batched.spec.request_id}")
        alone = clients.request(spec, lambda count: None)
        assert alone.same_as(batched)
    assert len({tuple(r.token_ids) for r in seeded}) == len(seeded)


def test_resuming_an_unknown_request_is_not_found(meshes: OneTargetAtATime) -> None:
    target, clients, _ = meshes.get("single")
    with pytest.raises(grpc.RpcError) as info:
        list(
            clients.stub.Generate(
                generate_pb2.GenerateRequest(request_id="never-seen", resume_from=5), timeout=30
            )
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


# Ids name the mesh too, so that `-k pd` (say) picks one mesh's rows.
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[f"{s.target}: {s.name}" for s in SCENARIOS])
def test_scenario_loses_nothing_and_changes_nothing(
    scenario: Scenario, meshes: OneTargetAtATime
) -> None:
    target, clients, calm = meshes.get(scenario.target)
    wait_ready(target)
    row = run_scenario(
        target, scenario, clients, calm, NUM_CLIENTS, REQUESTS_PER_CLIENT, MAX_TOKENS
    )
    print(" | ".join(row.cells()))
    assert row.failed == 0, row.errors
    assert row.identical, "a stream differs from its undisturbed run"
    assert row.constrained_valid == row.constrained_ended > 0, row  # structured output holds
    if scenario.no_fault:
        return
    assert row.detect_s is not None and row.recover_s is not None, row
    if "frozen" in scenario.name or "cut" in scenario.name:
        assert row.detect_s <= HANG_DETECT_S and row.recover_s <= HANG_RECOVER_S, row
