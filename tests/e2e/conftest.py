"""Meshes shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagemesh.runtime.ports import reserve_port
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.mesh_harness import Mesh


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", "llama", seed=1)


@pytest.fixture(scope="session")
def tiny_llama_mesh(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    # A small cache (64 blocks of 16 tokens) so that block accounting is easy to observe.
    log = tmp_path_factory.mktemp("logs") / "tiny-llama-mesh.log"
    mesh = Mesh(
        str(tiny_llama_dir),
        log,
        redis_url=redis_url,
        cluster="e2e-llama",
        extra_args=["--num-kv-blocks", "64"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


@pytest.fixture(scope="session")
def smollm2_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """The default model through `pagemesh up` with no --model and no --redis-url (what
    `make run` starts, its embedded Valkey included), but in fp32 on every CPU (auto is
    bf16 where the CPU has native bf16, and the references are fp32). Its OpenAI HTTP API
    is at `mesh.http_url`."""
    http_port = reserve_port()
    mesh = Mesh(
        None,
        tmp_path_factory.mktemp("logs") / "smollm2.log",
        cluster="e2e-smollm2",
        extra_args=["--dtype", "float32", "--http-port", str(http_port)],
    )
    mesh.http_url = f"http://127.0.0.1:{http_port}"  # type: ignore[attr-defined]
    try:
        yield mesh.wait_ready()
    finally:
        assert mesh.stop() == 0, mesh.log()
