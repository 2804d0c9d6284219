"""A frozen Redis does not take the mesh down (docs/security.md, "Bounded Redis"): `pagemesh
up`'s embedded Valkey SIGSTOPped under a live mesh. Fresh requests are served meanwhile
(their checkpoint lookup times out as "none"), a stream in flight goes on, and `up` neither
restarts Valkey beside the frozen one nor exits; frozen for longer than its grace, Valkey is
killed and replaced, and the mesh serves on."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, greedy_request

GRACE_S = 12.0  # PAGEMESH_VALKEY_FROZEN_GRACE_S for this mesh
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    # No --redis-url: `up` embeds its own Valkey, with a password.
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / "frozen-redis.log",
        cluster="e2e-frozen",
        extra_args=["--num-kv-blocks", "96", "--log-level", "INFO"],
        env={"PAGEMESH_VALKEY_FROZEN_GRACE_S": str(GRACE_S)},
    )
    try:
        yield mesh.wait_ready()
    finally:
        pid = valkey_pid(mesh)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        mesh.stop()


def valkey_pid(mesh: Mesh) -> int | None:
    for pid in mesh.child_pids():
        try:
            if b"valkey-server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def timed_request(mesh: Mesh, request_id: str) -> float:
    started = time.monotonic()
    result = mesh.generate(greedy_request(PROMPT, 4, request_id=request_id), timeout_s=30)
    assert len(result.token_ids) == 4
    return time.monotonic() - started


def test_fresh_requests_and_streams_in_flight_go_on_while_valkey_is_frozen(mesh: Mesh) -> None:
    pid = valkey_pid(mesh)
    assert pid is not None
    timed_request(mesh, "warm-up")
    stream = mesh.stub.Generate(greedy_request(PROMPT, 200, request_id="in-flight"), timeout=120)
    first = next(stream)
    os.kill(pid, signal.SIGSTOP)
    try:
        latencies = [timed_request(mesh, f"fresh-{i}") for i in range(8)]
        rest = sum(len(chunk.token_ids) for chunk in stream)
    finally:
        os.kill(pid, signal.SIGCONT)
    print(
        f"fresh requests while Valkey was frozen: max {max(latencies):.3f} s, "
        f"median {sorted(latencies)[len(latencies) // 2]:.3f} s over {len(latencies)}"
    )
    assert len(first.token_ids) + rest == 200  # the stream in flight went on
    assert max(latencies) <= 2.0, latencies
    assert mesh.process.poll() is None and valkey_pid(mesh) == pid  # not restarted, not exited
    assert "already in use" not in mesh.log()


def test_valkey_frozen_past_its_grace_is_replaced(mesh: Mesh) -> None:
    pid = valkey_pid(mesh)
    os.kill(pid, signal.SIGSTOP)
    try:
        eventually(
            lambda: valkey_pid(mesh) not in (None, pid),
            4 * GRACE_S,
            "the frozen Valkey was never replaced",
        )
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert mesh.process.poll() is None
    # The services re-register in the new one; requests are served again.
    eventually(lambda: _serves(mesh), 60, "the mesh did not serve after Valkey was replaced")


def _serves(mesh: Mesh) -> bool:
    try:
        return timed_request(mesh, f"after-{time.monotonic()}") < 30
    except Exception:
        return False
