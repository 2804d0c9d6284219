"""docs/deploy.md names files, variables, services and profiles of compose/multi-host/; a
rename there must fail here rather than leave the step-by-step guide wrong."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
DOC = ROOT / "docs" / "deploy.md"
MULTI_HOST = ROOT / "compose" / "multi-host"


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def _compose(name: str) -> dict:
    return yaml.safe_load((MULTI_HOST / name).read_text())


@pytest.fixture(scope="module")
def doc() -> str:
    if not (MULTI_HOST / "head.yml").exists():
        pytest.skip("compose/multi-host/ is not there yet")
    return DOC.read_text()


def test_named_files_exist(doc: str) -> None:
    for path in set(re.findall(r"`(compose/[\w./-]+|docs/[\w./-]+|scripts/[\w./-]+)`", doc)):
        assert (ROOT / path).exists(), path
    for name in ("head.yml", "gpu-host.yml", ".env.example"):
        assert name in doc and (MULTI_HOST / name).exists(), name


def test_env_variables_are_those_of_the_example(doc: str) -> None:
    example = (MULTI_HOST / ".env.example").read_text()
    known = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=", example, re.M))
    assigned = {
        name
        for block in _code_blocks(doc)
        for name in re.findall(r"^(?:#\s*\w.*?:\s+)?([A-Z][A-Z0-9_]*)=", block, re.M)
    }
    assigned |= set(
        re.findall(
            r"\b([A-Z][A-Z0-9_]+)=\S",
            " ".join(
                line
                for block in _code_blocks(doc)
                for line in block.splitlines()
                if line.lstrip().startswith("#")
            ),
        )
    )
    assert assigned, "the doc sets no variables?"
    assert assigned <= known, f"not in .env.example: {sorted(assigned - known)}"


def test_services_and_profiles_exist(doc: str) -> None:
    head = _compose("head.yml")["services"]
    gpu = _compose("gpu-host.yml")["services"]
    for service in re.findall(
        r"-f head\.yml[^\n]*? (?:exec(?: -it)?|logs|stop(?: -t \d+)?) ([a-z][\w-]*)", doc
    ):
        assert service in head or service.startswith("scheduler-g"), service
    for service in re.findall(
        r"-f gpu-host\.yml[^\n]*? (?:up -d|logs(?: -f)?|stop(?: -t \d+)?) ([a-z][\w-]*)", doc
    ):
        assert service in gpu, service
    profiles = {p for service in gpu.values() for p in service.get("profiles", [])}
    for profile in re.findall(r"COMPOSE_PROFILES=([\w,-]+)", doc):
        assert set(profile.split(",")) <= profiles, profile
    assert "scheduler" in head and "extends: {file: head.yml, service: scheduler}" in doc
