"""Fixtures of the compose tests: a models folder holding a tiny Llama, as the .env names it."""

from __future__ import annotations

import pytest

from pagemesh.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def model_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """MODELS_DIR (a host folder for /models) and MODEL (/models/tiny-llama, with two KV
    heads so that tp=2 splits them) for an .env."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(folder / "tiny-llama", "llama", seed=1, num_key_value_heads=2)
    return {"MODELS_DIR": str(folder), "MODEL": "/models/tiny-llama"}
