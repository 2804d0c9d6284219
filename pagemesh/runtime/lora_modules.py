"""`--lora-modules` as vLLM takes it: `name=path`, or a JSON object with `name` and `path`
(`base_model_name` is accepted and ignored: the adapter's base is the served model)."""

from __future__ import annotations

import json
from collections.abc import Iterable


def parse_lora_modules(values: Iterable[str] | None) -> dict[str, str]:
    """name -> folder; ValueError naming the entry that is not one, or a name given twice."""
    modules: dict[str, str] = {}
    for value in values or ():
        name, path = _one(value.strip())
        if not name or not path:
            raise ValueError(
                f"--lora-modules {value!r}: give name=path (or JSON with name and path)"
            )
        if name in modules:
            raise ValueError(f"--lora-modules names adapter {name!r} twice")
        modules[name] = path
    return modules


def _one(value: str) -> tuple[str, str]:
    if value.startswith("{"):
        try:
            data = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"--lora-modules {value!r} is not valid JSON: {exc}") from None
        return str(data.get("name") or ""), str(data.get("path") or "")
    name, _, path = value.partition("=")
    return name.strip(), path.strip()
