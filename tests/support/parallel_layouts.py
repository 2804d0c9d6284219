"""The parallel layouts every mesh-level parallel test runs, and a mesh of one of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tests.support.mesh_harness import Mesh

LAYOUTS = {  # name: (tp, pp, extra flags)
    "tp1": (1, 1, []),
    "tp2": (2, 1, []),
    "pp2-uneven": (1, 2, ["--pp-layer-split", "1,2"]),  # three layers over two stages
    "tp2xpp2": (2, 2, []),
}


@contextlib.contextmanager
def run_layout(
    name: str,
    model: Path,
    redis_url: str,
    log_dir: Path,
    *,
    cluster: str,
    extra_args: list[str] | None = None,
) -> Iterator[Mesh]:
    """A mesh of the layout, stopped when the `with` block ends, however it ends (a test
    that returns or fails inside it must not leave processes behind)."""
    tp, pp, layout_args = LAYOUTS[name]
    mesh = Mesh(
        str(model),
        log_dir / f"{cluster}.log",
        redis_url=redis_url,
        cluster=cluster,
        extra_args=["--tp", str(tp), "--pp", str(pp), *layout_args, *(extra_args or [])],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()
