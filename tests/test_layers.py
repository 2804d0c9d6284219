"""The import layers (docs/contributing.md): every arrow points down. From the ground up:
`protos` and `kernels`; `pagemesh.runtime`, what the services share; `pagemesh.api`, the
client API; the three services, which never import one another; the offline engine
(`offline`) and the tools (`pagemesh.tools`) on top; `pagemesh/__init__.py` names the offline
engine's API as strings. Function-level imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVICES = {"router", "scheduler_svc", "worker_svc"}
GROUND = {"protos", "kernels"}
# Each layer (a package, by its dotted prefix) and the layers it may import besides itself.
ALLOWED = {
    "protos": set(),
    "kernels": {"protos"},
    "pagemesh.runtime": GROUND,
    "pagemesh.api": GROUND | {"pagemesh.runtime"},
    **{service: GROUND | {"pagemesh.runtime", "pagemesh.api"} for service in SERVICES},
    "offline": GROUND | SERVICES | {"pagemesh.runtime", "pagemesh.api"},
    "pagemesh.tools": GROUND | {"pagemesh.runtime", "pagemesh.api"},
}


def _layer(module: str) -> str | None:
    """The layer of a dotted module name of this repository, None for a third party."""
    for layer in sorted(ALLOWED, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return "pagemesh" if module == "pagemesh" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module)]
            if node.module == "pagemesh":  # `from pagemesh import runtime` names a layer
                found += [(node.lineno, f"pagemesh.{alias.name}") for alias in node.names]
    return found


def _files(layer: str) -> list[Path]:
    return sorted((ROOT / layer.replace(".", "/")).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_every_import_points_down(layer: str) -> None:
    wrong = []
    for path in _files(layer):
        for line, module in _imports(path):
            target = _layer(module)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({target})")
    assert not wrong, f"{layer} may import only {sorted(ALLOWED[layer])}:\n" + "\n".join(wrong)


def test_the_package_face_imports_no_layer_above_the_client_api() -> None:
    """`pagemesh.LLM` (offline/) is loaded by name on first use, never imported here."""
    layers = {_layer(m) for _, m in _imports(ROOT / "pagemesh" / "__init__.py")} - {None}
    assert layers <= {"pagemesh.runtime", "pagemesh.api"}, layers


def test_every_package_module_is_in_a_layer() -> None:
    """A new module of pagemesh/ goes into runtime/, api/ or tools/: nothing sits beside them
    where no rule above would see it."""
    loose = [p.name for p in (ROOT / "pagemesh").glob("*.py") if p.name != "__init__.py"]
    assert not loose, f"pagemesh/{loose}: move into pagemesh/runtime, api or tools"
