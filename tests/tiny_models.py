"""Tiny random Llama-family checkpoints for tests: `pagemesh/testing/tiny_models.py`, where
the benchmarks find them too (bench/ imports nothing from tests/)."""

from pagemesh.testing.tiny_models import write_tiny_model

__all__ = ["write_tiny_model"]
