"""Starts real meshes for tests: `pagemesh up` as a process, real gRPC, real Valkey.

The mesh client is product code (`pagemesh/mesh_process.py`, which the benchmarks use too);
this layer only runs its meshes from this checkout, whatever pytest's working directory.
"""

from __future__ import annotations

from pathlib import Path

from pagemesh import mesh_process
from pagemesh.mesh_process import Generation, alive, free_port, greedy_request
from tests.support.paths import REPO_ROOT


__all__ = ["REPO_ROOT", "Generation", "Mesh", "alive", "free_port", "greedy_request"]


class Mesh(mesh_process.Mesh):
    """`pagemesh.mesh_process.Mesh` whose services run from this checkout by default."""

    def __init__(self, model: str | None, log_path: Path, *, repo_root: Path = REPO_ROOT,
                 **kwargs: object) -> None:
        super().__init__(model, log_path, repo_root=repo_root, **kwargs)
