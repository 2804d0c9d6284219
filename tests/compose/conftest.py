"""Fixtures of the compose tests: a models folder holding a tiny Llama, and the mesh's secrets,
as the .env names them."""

from __future__ import annotations

import pytest

from pagemesh.tools.mesh_secrets import write_secrets
from pagemesh.tools.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def model_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """MODELS_DIR (a host folder for /models), MODEL (/models/tiny-llama, with two KV heads
    so that tp=2 splits them) and SECRETS_DIR (what `pagemesh secrets DIR` writes) for an
    .env."""
    folder = tmp_path_factory.mktemp("models")
    write_tiny_model(folder / "tiny-llama", "llama", seed=1, num_key_value_heads=2)
    secrets = tmp_path_factory.mktemp("secrets")
    write_secrets(secrets)
    return {"MODELS_DIR": str(folder), "MODEL": "/models/tiny-llama", "SECRETS_DIR": str(secrets)}
