"""`scheduler_svc/convert/` is the scheduler's only bridge to protobuf messages (its
docstring says so): the other files that import generated modules do it for the gRPC
plumbing alone, and the rest import none."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler_svc

# File -> the generated modules it may import, and why.
ALLOWED = {
    # The bridge itself, a package split by the messages each module converts (its
    # __init__.py names them all and imports no generated module itself).
    "convert/requests.py": {"scheduler_pb2", "generate_pb2"},  # the router's submits
    "convert/steps.py": {"worker_pb2", "generate_pb2"},  # the workers' steps
    "convert/group_info.py": {"worker_pb2", "generate_pb2", "scheduler_pb2"},
    # admin_pb2: the workers' admin reports, passed through.
    "convert/admin.py": {"worker_pb2", "scheduler_pb2", "admin_pb2"},
    "convert/kv.py": {"worker_pb2", "scheduler_pb2", "admin_pb2"},  # KV moves, drains
    # The service it implements and registers; messages pass straight to convert.
    # admin_pb2: the LoRA admin calls' request types (their replies: convert/admin.py).
    "servicer.py": {"scheduler_pb2", "scheduler_pb2_grpc", "generate_pb2", "admin_pb2"},
    "worker_client.py": {"worker_pb2_grpc"},  # the workers' stubs
    "kv_moves.py": {"scheduler_pb2_grpc"},  # other groups' schedulers, for their KV holds
}


def _generated_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names if "_pb2" in a.name)
            if node.module and "_pb2" in node.module:
                names.add(node.module.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Import):
            names.update(a.name.rsplit(".", 1)[-1] for a in node.names if "_pb2" in a.name)
    return names


def test_only_convert_builds_protobuf_and_only_plumbing_imports_grpc_modules() -> None:
    package = Path(scheduler_svc.__file__).parent
    found = {
        p.relative_to(package).as_posix(): _generated_imports(p)
        for p in sorted(package.rglob("*.py"))
    }
    offenders = {
        name: imports - ALLOWED.get(name, set())
        for name, imports in found.items()
        if imports - ALLOWED.get(name, set())
    }
    assert not offenders, f"protobuf imported outside convert/: {offenders}"
    bridge = [name for name in ALLOWED if name.startswith("convert/")]
    assert all(found[name] for name in bridge), "convert/ is the bridge"
