"""Each service option is declared once (pagemesh.runtime.service_flags): the services' parsers and
`pagemesh up`'s agree on it, and `up` hands every service the values it was given."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any
from unittest import mock

import pytest

from pagemesh.runtime.service_flags import (
    OPTIONS,
    ROUTER_OPTIONS,
    SCHEDULER_OPTIONS,
    WORKER_OPTIONS,
    option,
    options_argv,
)
from pagemesh.runtime.service_flags_base import ROUTER, SCHEDULER, WORKER, ServiceFlag
from pagemesh.tools import cli
from pagemesh.tools.local_mesh import service_specs
from router import main as router_main
from router.routing import POLICIES as ROUTING_POLICIES
from scheduler_svc import main as scheduler_main
from scheduler_svc.core.config import DEFAULT_PREEMPTION_MODE, PREEMPTION_MODES, SchedulerConfig
from scheduler_svc.core.policy import POLICIES as SCHEDULING_POLICIES
from worker_svc import main as worker_main
from worker_svc.kv_budget import DEFAULT_CPU_KV_CACHE_FRACTION, DEFAULT_GPU_MEMORY_UTILIZATION
from worker_svc.quant import QUANTIZATION_CHOICES

# What a service declares itself: where it serves, where the registry is, who it is.
_SERVER = {
    "--host",
    "--port",
    "--advertise-host",
    "--metrics-port",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--tls-client-ca",
    "--redis-url",
    "--redis-password",
    "--cluster",
}
OWN_FLAGS = {
    ROUTER: _SERVER | {"--router-id", "--http-port"},
    SCHEDULER: _SERVER | {"--group", "--scheduler-id", "--tp", "--pp", "--role"},
    WORKER: _SERVER
    | {
        "--device",
        "--group",
        "--worker-id",
        "--tp",
        "--tp-rank",
        "--pp",
        "--pp-rank",
        "--standby",
        "--dist-port",
        "--kv-transfer-port",
    },
}
# What `up` declares itself: the topology.
UP_FLAGS = {
    "--port",
    "--http-port",
    "--host",
    "--redis-url",
    "--redis-password",
    "--cluster",
    "--replicas",
    "--prefill-replicas",
    "--decode-replicas",
    "--device",
    "--standby",
    "--tp",
    "--pp",
    "--tls-cert",
    "--tls-key",
    "--tls-ca",
    "--tls-client-ca",
    # How up starts its CPU workers (LD_PRELOAD, their cores), not service options.
    "--malloc",
    "--cpu-bind",
    "--omp-wait",
}
TABLES = {ROUTER: ROUTER_OPTIONS, SCHEDULER: SCHEDULER_OPTIONS, WORKER: WORKER_OPTIONS}
MAINS = {ROUTER: router_main, SCHEDULER: scheduler_main, WORKER: worker_main}
MODULES = {"router.main": ROUTER, "scheduler_svc.main": SCHEDULER, "worker_svc.main": WORKER}


@pytest.fixture(autouse=True)
def no_pagemesh_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defaults as declared, whatever the environment running the tests sets."""
    for name in list(os.environ):
        if name.startswith("PAGEMESH_"):
            monkeypatch.delenv(name)


def up_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices["up"]


def actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each flag's action by its first name ("--x", not its "--no-x")."""
    return {
        action.option_strings[0]: action
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


def described(action: argparse.Action) -> tuple[Any, ...]:
    return type(action), action.dest, action.default, action.type, action.choices


def test_each_flag_is_declared_once() -> None:
    names = [flag.name for flag in OPTIONS]
    assert len(names) == len(set(names))
    assert not set(names) & UP_FLAGS
    for service, table in TABLES.items():
        assert not {flag.name for flag in table} & OWN_FLAGS[service]
    # Taken by two services, declared once: the table says who.
    assert set(option("--max-num-batched-tokens").services) == {SCHEDULER, WORKER}
    assert set(option("--model").services) == {ROUTER, WORKER}


@pytest.mark.parametrize("service", [ROUTER, SCHEDULER, WORKER])
def test_service_and_up_agree_on_every_option(service: str) -> None:
    """Same default, type, choices and kind (bool, repeatable) in the service's real parser
    and in `up`'s; and a service has no option `up` cannot reach."""
    own = actions(MAINS[service].build_parser())
    up = actions(up_parser())
    for flag in TABLES[service]:
        assert described(own[flag.name]) == described(up[flag.name]), flag.name
    assert set(own) == OWN_FLAGS[service] | {flag.name for flag in TABLES[service]}


def test_up_declares_only_topology_besides_the_options() -> None:
    assert set(actions(up_parser())) == UP_FLAGS | {flag.name for flag in OPTIONS}


def test_topology_flags_up_shares_with_a_service_agree() -> None:
    up = actions(up_parser())
    router = actions(router_main.build_parser())
    scheduler = actions(scheduler_main.build_parser())
    for name in ("--port", "--http-port", "--host", "--cluster"):
        assert up[name].default == router[name].default, name
    for name in ("--tp", "--pp"):
        assert up[name].default == scheduler[name].default, name


def test_choice_lists_and_defaults_agree_with_the_cores() -> None:
    assert option("--routing").choices == ROUTING_POLICIES
    assert option("--scheduling-policy").choices == SCHEDULING_POLICIES
    assert option("--preemption-mode").choices == PREEMPTION_MODES
    assert option("--quantization").choices == QUANTIZATION_CHOICES
    assert option("--gpu-memory-utilization").default == DEFAULT_GPU_MEMORY_UTILIZATION
    assert option("--cpu-kv-cache-fraction").default == DEFAULT_CPU_KV_CACHE_FRACTION
    core = SchedulerConfig(num_blocks=8)
    assert option("--block-size").default == core.block_size
    assert option("--max-num-batched-tokens").default == core.max_num_batched_tokens
    assert option("--max-num-seqs").default == core.max_num_seqs
    assert option("--enable-chunked-prefill").default == core.enable_chunked_prefill
    assert option("--long-prefill-token-threshold").default == core.long_prefill_token_threshold
    assert option("--enable-prefix-caching").default == core.enable_prefix_caching
    assert option("--scheduling-policy").default == core.policy


def test_preemption_default_is_one_fact() -> None:
    """swap, where the workers have swap space; recompute where they have none, as the
    scheduler service falls back."""
    assert option("--preemption-mode").default == DEFAULT_PREEMPTION_MODE == "swap"
    assert SchedulerConfig(num_blocks=8, num_swap_blocks=4).preemption_mode == "swap"
    assert SchedulerConfig(num_blocks=8).preemption_mode == "recompute"
    assert (
        SchedulerConfig(
            num_blocks=8, num_swap_blocks=4, preemption_mode="recompute"
        ).preemption_mode
        == "recompute"
    )


def non_default(flag: ServiceFlag) -> Any:
    if flag.repeatable:
        return ["key-a", "key-b"] if flag.secret else [f"{flag.dest}-a", f"{flag.dest}-b"]
    if flag.type is bool:
        return not flag.default
    if flag.choices:
        return next(choice for choice in flag.choices if choice != flag.default)
    if flag.type is int:
        return (flag.default or 0) + 3
    if flag.type is float:
        return (flag.default or 0.0) + 0.25
    return f"value-of-{flag.dest}"


def parse_up(argv: list[str]) -> argparse.Namespace:
    # Unbound, whatever this host's cores (auto binds where there are 4): the binding has
    # its own tests (test_cpu_placement.py); a later --cpu-bind in argv wins.
    return cli.build_parser().parse_args(["up", "--cpu-bind", "none", *argv])


def parsed_specs(args: argparse.Namespace, model: str) -> list[tuple[str, str, argparse.Namespace]]:
    """(name, service, what that service's own parser makes of the argv `up` gives it)."""
    parsed = []
    for spec in service_specs(args, model, "redis://127.0.0.1:1/0"):
        with mock.patch.dict(os.environ, spec.env):  # secrets come in the environment
            parsed.append(
                (spec.name, MODULES[spec.module], MAINS[MODULES[spec.module]].parse_args(spec.args))
            )
        assert not any(
            word in spec.args for flag in OPTIONS if flag.secret for word in non_default(flag)
        ), f"a secret on {spec.name}'s command line"
    return parsed


def up_argv(values: dict[str, Any]) -> list[str]:
    """`up`'s command line for `values`, secrets included (a user may type them there)."""
    secrets = [
        word
        for flag in OPTIONS
        if flag.secret
        for word in dataclasses.replace(flag, secret=False).argv(values[flag.dest])
    ]
    return [*options_argv(OPTIONS, values), *secrets]


def test_every_option_given_to_up_reaches_its_services() -> None:
    values = {flag.dest: non_default(flag) for flag in OPTIONS}
    args = parse_up([*up_argv(values), "--port", "50123", "--http-port", "0"])
    assert {flag.dest: getattr(args, flag.dest) for flag in OPTIONS} == values
    specs = parsed_specs(args, values["model"])
    assert sorted(service for _, service, _ in specs) == [ROUTER, SCHEDULER, WORKER]
    for name, service, parsed in specs:
        for flag in TABLES[service]:
            assert getattr(parsed, flag.dest) == values[flag.dest], (name, flag.name)
        if service == ROUTER:
            assert (parsed.port, parsed.http_port) == (50123, 0)


def test_defaults_reach_the_services_as_their_own() -> None:
    """`up` with no options gives each service its own defaults, but for what `up` decides:
    the model (and its name)."""
    specs = parsed_specs(parse_up([]), "/models/tiny")
    for name, service, parsed in specs:
        for flag in TABLES[service]:
            expected = {"model": "/models/tiny", "served_model_name": "tiny"}.get(
                flag.dest, flag.default
            )
            assert getattr(parsed, flag.dest) == expected, (name, flag.name)


def test_workers_of_one_cpu_host_share_its_memory_and_cores() -> None:
    specs = parsed_specs(
        parse_up(["--tp", "2", "--standby", "1", "--cpu-kv-cache-fraction", "0.6"]), "/models/tiny"
    )
    workers = {name: parsed for name, service, parsed in specs if service == WORKER}
    assert sorted(workers) == ["worker-g0-pp0-tp0", "worker-g0-pp0-tp1", "worker-g0-standby0"]
    for parsed in workers.values():
        assert parsed.cpu_kv_cache_fraction == pytest.approx(0.2)
        assert parsed.torch_threads == max(1, (os.cpu_count() or 1) // 3)
        assert (parsed.tp, parsed.device) == (2, "cpu")
    assert [workers[f"worker-g0-pp0-tp{rank}"].tp_rank for rank in (0, 1)] == [0, 1]
    assert workers["worker-g0-standby0"].standby
    threads = parsed_specs(parse_up(["--tp", "2", "--torch-threads", "5"]), "/models/tiny")
    assert {parsed.torch_threads for _, service, parsed in threads if service == WORKER} == {5}


def test_replicas_get_their_own_groups_and_gpus() -> None:
    specs = parsed_specs(parse_up(["--replicas", "2", "--device", "cuda"]), "/models/tiny")
    groups = {
        name: (parsed.group, getattr(parsed, "device", None))
        for name, _, parsed in specs
        if name != "router"
    }
    assert groups == {
        "worker-g0-pp0-tp0": ("g0", "cuda:0"),
        "scheduler-g0": ("g0", None),
        "worker-g1-pp0-tp0": ("g1", "cuda:1"),
        "scheduler-g1": ("g1", None),
    }


def test_only_the_router_binds_the_wildcard_address() -> None:
    """`up --host 0.0.0.0` (the image's command) opens the router to the network; schedulers
    and workers bind the address they advertise, which nobody outside the host needs."""
    for name, service, parsed in parsed_specs(parse_up(["--host", "0.0.0.0"]), "/models/tiny"):
        assert parsed.host == ("0.0.0.0" if service == ROUTER else "127.0.0.1"), name
    for name, _, parsed in parsed_specs(parse_up(["--host", "10.1.2.3"]), "/models/tiny"):
        assert parsed.host == "10.1.2.3", name


def test_expert_balancing_without_expert_parallelism_is_refused_before_anything_starts():
    from pagemesh.runtime.service_flags_worker import expert_parallel_error
    from pagemesh.tools import cli

    assert expert_parallel_error(True, 100) is None and expert_parallel_error(False, 0) is None
    assert "needs --enable-expert-parallel" in expert_parallel_error(False, 8)
    assert "must be 0 (never) or more" in expert_parallel_error(True, -1)
    args = cli.build_parser().parse_args(["up", "--eplb-interval-steps", "8"])
    with pytest.raises(SystemExit, match="needs --enable-expert-parallel"):
        args.func(args)
