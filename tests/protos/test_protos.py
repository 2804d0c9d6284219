"""The checked-in generated modules must match the .proto files (run `make protos`)."""

from __future__ import annotations

from pathlib import Path

from protos.codegen import REPO_ROOT, generate


def test_generated_code_is_current(tmp_path: Path) -> None:
    generate(tmp_path)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert generated, "protoc produced nothing"
    stale = [
        str(rel)
        for rel in generated
        if (tmp_path / rel).read_bytes() != (REPO_ROOT / rel).read_bytes()
    ]
    assert not stale, f"stale generated code, run `make protos`: {stale}"
    checked_in = sorted(
        p.relative_to(REPO_ROOT)
        for p in (REPO_ROOT / "protos").rglob("*_pb2*.py*")
        if "__pycache__" not in p.parts
    )  # bytecode of an import, not a module
    assert checked_in == generated, "generated modules without a .proto (or the reverse)"
