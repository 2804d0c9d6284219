"""`pagemesh up --malloc`: which allocator CPU workers preload, and that a worker started
that way really runs with it (its /proc maps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagemesh.tools import cli
from pagemesh.tools.local_mesh import service_specs
from pagemesh.tools.malloc_preload import find_malloc, preload_env


def _fake_libs(folder: Path, *names: str) -> tuple[str, ...]:
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return (str(folder),)


def test_auto_prefers_tcmalloc_then_jemalloc_then_nothing(tmp_path):
    both = _fake_libs(tmp_path / "both", "libjemalloc.so.2", "libtcmalloc_minimal.so.4")
    assert find_malloc("auto", both) == tmp_path / "both" / "libtcmalloc_minimal.so.4"
    jemalloc = _fake_libs(tmp_path / "je", "libjemalloc.so.2")
    assert find_malloc("auto", jemalloc) == tmp_path / "je" / "libjemalloc.so.2"
    assert find_malloc("auto", (str(tmp_path / "none"),)) is None
    assert find_malloc("system", both) is None


def test_a_named_allocator_that_is_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="apt install libjemalloc2"):
        find_malloc("jemalloc", (str(tmp_path),))
    with pytest.raises(ValueError, match="must be one of"):
        find_malloc("mimalloc", (str(tmp_path),))


def test_the_callers_preload_is_kept_after_ours():
    lib = Path("/x/libtcmalloc_minimal.so.4")
    assert preload_env(lib, {"LD_PRELOAD": "/y/libfoo.so"}) == {
        "LD_PRELOAD": "/x/libtcmalloc_minimal.so.4:/y/libfoo.so"
    }
    assert preload_env(lib, {}) == {"LD_PRELOAD": "/x/libtcmalloc_minimal.so.4"}
    assert preload_env(None, {"LD_PRELOAD": "/y/libfoo.so"}) == {}


def test_up_preloads_only_cpu_workers(monkeypatch):
    monkeypatch.setattr(
        "pagemesh.tools.local_mesh.find_malloc",
        lambda choice: None if choice == "system" else Path("/lib/libt.so"),
    )
    args = cli.build_parser().parse_args(["up"])
    specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
    assert specs["worker-g0-pp0-tp0"].env["LD_PRELOAD"].startswith("/lib/libt.so")
    assert "LD_PRELOAD" not in specs["scheduler-g0"].env
    assert "LD_PRELOAD" not in specs["router"].env
    for argv in (["up", "--malloc", "system"], ["up", "--device", "cuda"]):
        args = cli.build_parser().parse_args(argv)
        specs = {spec.name: spec for spec in service_specs(args, "m", "redis://127.0.0.1:1/0")}
        assert "LD_PRELOAD" not in specs["worker-g0-pp0-tp0"].env


@pytest.mark.skipif(
    find_malloc("auto") is None,
    reason="neither tcmalloc nor jemalloc is "
    "installed here (Debian libtcmalloc-minimal4 / libjemalloc2)",
)
def test_a_process_started_with_the_preload_maps_the_allocator():
    library = find_malloc("auto")
    env = {**os.environ, **preload_env(library)}
    maps = subprocess.run(
        [sys.executable, "-c", "print(open('/proc/self/maps').read())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert library.name in maps
