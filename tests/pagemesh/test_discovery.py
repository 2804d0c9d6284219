"""Finding a local `pagemesh up` from its state file: flags first, then the newest live mesh
(of the cluster asked for), then the defaults; files of dead processes are ignored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagemesh.tools import discovery
from pagemesh.tools.discovery import LocalMesh


def mesh(
    pid: int, cluster: str = "pagemesh", started_at: float = 100.0, port: int = 16379
) -> LocalMesh:
    return LocalMesh(
        pid=pid,
        redis_url=f"redis://127.0.0.1:{port}/0",
        cluster=cluster,
        router_address=f"127.0.0.1:{port + 1}",
        started_at=started_at,
    )


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_state_dir_follows_the_variables(tmp_path: Path) -> None:
    assert discovery.state_dir({discovery.STATE_DIR_ENV: str(tmp_path)}) == tmp_path
    assert discovery.state_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/pagemesh/meshes")
    assert discovery.state_dir({}).parts[-3:] == (".cache", "pagemesh", "meshes")


def test_announced_meshes_are_found_newest_first_and_withdrawn(tmp_path: Path) -> None:
    older = discovery.announce(mesh(os.getpid(), started_at=100.0), tmp_path)
    parent = discovery.announce(mesh(os.getppid(), "other", started_at=200.0, port=20000), tmp_path)
    found = discovery.local_meshes(tmp_path)
    assert [m.cluster for m in found] == ["other", "pagemesh"]
    assert found[1].state_file == str(older)
    assert discovery.find_local_mesh("pagemesh", tmp_path).pid == os.getpid()
    assert discovery.find_local_mesh("nope", tmp_path) is None
    discovery.withdraw(parent)
    discovery.withdraw(parent)  # twice is fine
    assert [m.cluster for m in discovery.local_meshes(tmp_path)] == ["pagemesh"]


def test_a_dead_mesh_is_ignored_and_its_file_removed(tmp_path: Path) -> None:
    stale = discovery.announce(mesh(dead_pid()), tmp_path)
    (tmp_path / "junk.json").write_text("{not json")
    assert discovery.local_meshes(tmp_path) == []
    assert not stale.exists()


def test_flags_then_the_local_mesh_then_the_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "none"
    registry = discovery.resolve_registry(None, None, empty)
    assert (registry.redis_url, registry.cluster) == ("redis://127.0.0.1:6379/0", "pagemesh")
    assert "the default" in registry.source and str(empty) in registry.source
    assert discovery.resolve_router(None, None, empty).address == "127.0.0.1:50051"
    discovery.announce(mesh(os.getpid(), "mine"), tmp_path)
    registry = discovery.resolve_registry(None, None, tmp_path)
    assert (registry.redis_url, registry.cluster) == ("redis://127.0.0.1:16379/0", "mine")
    assert f"pid {os.getpid()}" in registry.source
    assert discovery.resolve_router(None, None, tmp_path).address == "127.0.0.1:16380"
    given = discovery.resolve_registry("redis://elsewhere:1/0", None, tmp_path)
    assert (given.redis_url, given.cluster, given.source) == (
        "redis://elsewhere:1/0",
        "pagemesh",
        "--redis-url",
    )
    assert discovery.resolve_router("h:1", None, tmp_path).address == "h:1"
    other = discovery.resolve_registry(None, "theirs", tmp_path)  # not the local mesh's cluster
    assert other.redis_url == discovery.DEFAULT_REDIS_URL and "'theirs'" in other.source
