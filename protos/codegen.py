"""Regenerates the checked-in Python modules from the .proto files.

`make protos` runs `python -m protos.codegen`; `tests/protos/test_protos.py` runs `generate()` into
a
temporary folder and fails when the checked-in modules differ (someone edited a .proto and
forgot to regenerate).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILES = (
    "protos/pagemesh/v1/generate.proto",
    "protos/pagemesh/v1/admin.proto",
    "protos/pagemesh/scheduler/v1/scheduler.proto",
    "protos/pagemesh/worker/v1/worker.proto",
)


def generate(out_dir: Path = REPO_ROOT) -> None:
    """Writes `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` under `out_dir`, mirroring `protos/`.

    The include root is the repository root, so generated imports read
    `from protos.pagemesh.v1 import generate_pb2` and work untouched.
    """
    from grpc_tools import protoc  # build-time dependency only

    out_dir.mkdir(parents=True, exist_ok=True)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(REPO_ROOT / name) for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
