"""Finding a local `pagemesh up` mesh, so that `top`, `health`, `admin` and `profile` work
with no flags.

While it runs, `pagemesh up` announces itself in a small JSON file, `<pid>.json`, in the
state folder: `$PAGEMESH_STATE_DIR` when set, else `$XDG_CACHE_HOME/pagemesh/meshes`, else
`~/.cache/pagemesh/meshes`. It holds the Redis URL (the embedded Valkey's port is chosen at
start), the cluster and the router's address; the file is removed when the mesh stops, and
the file of a process that no longer runs is ignored (and cleaned up).

A command resolves each setting in this order: its flag (or `PAGEMESH_*` variable), then the
newest live local mesh (of the `--cluster` given, if one was), then the built-in default, and
says which one it used when it fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATE_DIR_ENV = "PAGEMESH_STATE_DIR"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_CLUSTER = "pagemesh"
DEFAULT_ROUTER_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class LocalMesh:
    """What a running `pagemesh up` tells the commands about itself."""

    pid: int  # the `pagemesh up` process
    redis_url: str
    cluster: str
    router_address: str  # host:port of the router's gRPC API
    http_url: str = ""  # the OpenAI API's base URL, "" when off
    started_at: float = 0.0  # wall-clock seconds
    state_file: str = ""  # where it was read from (not written)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "state_file"}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], state_file: str = "") -> LocalMesh:
        """Raises ValueError for a file that is not one of these."""
        try:
            return cls(
                pid=int(raw["pid"]),
                redis_url=str(raw["redis_url"]),
                cluster=str(raw["cluster"]),
                router_address=str(raw["router_address"]),
                http_url=str(raw.get("http_url") or ""),
                started_at=float(raw.get("started_at") or 0.0),
                state_file=state_file,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a local mesh record: {exc}") from exc


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder local meshes announce themselves in (see the module's docstring)."""
    env = os.environ if environ is None else environ
    if env.get(STATE_DIR_ENV):
        return Path(env[STATE_DIR_ENV]).expanduser()
    cache = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "pagemesh" / "meshes"


def announce(mesh: LocalMesh, folder: Path | None = None) -> Path:
    """Writes `mesh`'s file (in one rename, so a reader never sees half of it); returns its
    path, for `withdraw`."""
    folder = folder or state_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{mesh.pid}.json"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mesh-", suffix=".tmp")
    with os.fdopen(fd, "w") as out:
        json.dump(mesh.to_json(), out, indent=2)
    os.replace(tmp, path)
    return path


def withdraw(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def local_meshes(folder: Path | None = None) -> list[LocalMesh]:
    """The live local meshes, newest first. Files of processes that are gone are removed."""
    folder = folder or state_dir()
    meshes = []
    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            mesh = LocalMesh.from_json(json.loads(path.read_text()), str(path))
        except (OSError, ValueError):  # being written, or not ours
            continue
        if _alive(mesh.pid):
            meshes.append(mesh)
        else:
            withdraw(path)  # its `pagemesh up` was killed before it could clean up
    return sorted(meshes, key=lambda m: m.started_at, reverse=True)


def find_local_mesh(cluster: str | None = None, folder: Path | None = None) -> LocalMesh | None:
    """The newest live local mesh (of `cluster` when given), or None."""
    for mesh in local_meshes(folder):
        if cluster is None or mesh.cluster == cluster:
            return mesh
    return None


@dataclass(frozen=True)
class Registry:
    """Where a command reads the registry, and how that was decided (for its messages)."""

    redis_url: str
    cluster: str
    source: str


def resolve_registry(
    redis_url: str | None, cluster: str | None, folder: Path | None = None
) -> Registry:
    """`--redis-url`/`--cluster` as given, else a local mesh's, else the defaults."""
    if redis_url:
        return Registry(redis_url, cluster or DEFAULT_CLUSTER, "--redis-url")
    mesh = find_local_mesh(cluster, folder)
    if mesh is not None:
        return Registry(mesh.redis_url, mesh.cluster, _describe(mesh))
    return Registry(
        DEFAULT_REDIS_URL,
        cluster or DEFAULT_CLUSTER,
        f"the default; no local `pagemesh up`{_of(cluster)} announced itself in "
        f"{folder or state_dir()}",
    )


@dataclass(frozen=True)
class RouterAddress:
    address: str
    source: str


def resolve_router(
    address: str | None, cluster: str | None = None, folder: Path | None = None
) -> RouterAddress:
    """`--address` as given, else a local mesh's router, else the default."""
    if address:
        return RouterAddress(address, "--address")
    mesh = find_local_mesh(cluster, folder)
    if mesh is not None:
        return RouterAddress(mesh.router_address, _describe(mesh))
    return RouterAddress(
        DEFAULT_ROUTER_ADDRESS,
        f"the default; no local `pagemesh up`{_of(cluster)} announced itself "
        f"in {folder or state_dir()}",
    )


def _describe(mesh: LocalMesh) -> str:
    age_s = max(0.0, time.time() - mesh.started_at)
    return (
        f"the local `pagemesh up` (pid {mesh.pid}, cluster {mesh.cluster!r}, started "
        f"{age_s:.0f} s ago, {mesh.state_file})"
    )


def _of(cluster: str | None) -> str:
    return "" if cluster is None else f" of cluster {cluster!r}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
