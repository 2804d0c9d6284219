"""No split brain (docs/security.md): a scheduler cut off the network for longer than the
registry TTL is replaced; when its network comes back it must not take its group back from
the replacement. Two holders of one registry id, each in its own network namespace, the
first one partitioned (its link down, packets dropped) past the TTL: its heartbeat's
compare-and-set fails once it is back, it fences itself and exits, and the replacement's
entry is untouched."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from pagemesh.tools.testing.netns import Host, HostNetwork, namespaces_unavailable
from tests.support.claim_holder import FENCED_EXIT
from tests.support.eventually import eventually
from tests.support.paths import REPO_ROOT

pytestmark = pytest.mark.skipif(
    namespaces_unavailable() is not None, reason=namespaces_unavailable() or ""
)

TTL_S = 1.5
CLUSTER = "split-brain"


@pytest.fixture
def network() -> Iterator[HostNetwork]:
    network = HostNetwork(prefix="10.213.91").open()
    try:
        yield network
    finally:
        network.close()


def holder(host: Host, redis_url: str) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        host.argv(
            sys.executable,
            "-m",
            "tests.support.claim_holder",
            redis_url,
            CLUSTER,
            "scheduler",
            "g0",
            str(TTL_S),
        ),
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("claimed "), line + process.stdout.read()
    return process, line.split()[1]


def test_a_scheduler_back_from_a_partition_does_not_take_its_group_back(
    network: HostNetwork,
) -> None:
    from tests.e2e.test_multihost import valkey_binary

    head, first_host, second_host = (network.add_host(r) for r in ("head", "s1", "s2"))
    valkey = subprocess.Popen(
        head.argv(
            valkey_binary(),
            "--bind",
            head.address,
            "--port",
            "6379",
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    redis_url = f"redis://{head.address}:6379/0"
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    processes = [valkey]
    try:
        eventually(lambda: _pings(client), 20, "Valkey did not start")
        first, first_instance = holder(first_host, redis_url)
        processes.append(first)
        key = f"{CLUSTER}:scheduler:g0"
        first_host.partition()
        # Past the TTL its entry expires; the replacement claims the group.
        second, second_instance = holder(second_host, redis_url)
        processes.append(second)
        assert json.loads(client.get(key))["instance"] == second_instance
        time.sleep(TTL_S)
        first_host.heal()
        assert first.wait(timeout=30) == FENCED_EXIT  # it fenced itself and stopped
        for _ in range(4):  # the replacement keeps its entry; nobody overwrote it
            assert json.loads(client.get(key))["instance"] == second_instance
            time.sleep(TTL_S / 2)
        assert second.poll() is None
        fence = json.loads(client.get(f"{CLUSTER}:fenced:{first_instance}"))
        assert "lost its registry claim" in fence["reason"]
    finally:
        for process in processes:
            process.kill()
            process.wait()
        client.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
