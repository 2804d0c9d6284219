"""The faults done to a mesh's processes: a member, a scheduler or a router signalled (killed,
frozen, told to drain), Valkey or Redis killed, a host cut off the network; and a long step
on healthy workers that must not be taken for a fault. Each `prepare` (or a factory of one)
picks its victim and returns the `Action` that strikes; `after` checks run once the streams
ended."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from bench.faults.baseline import Action, Baseline
from bench.faults.targets import Target


def _signal(pid: int, signum: int) -> Action:
    return lambda: os.kill(pid, signum)


def kill_member(
    tp_rank: int = 0, pp_rank: int = 0, signum: int = signal.SIGKILL, group: str | None = None
) -> Callable[[Target, Baseline], Action]:
    """Signals the member at (pp_rank, tp_rank) of `group` (default: the target's first)."""

    def prepare(target: Target, base: Baseline) -> Action:
        if group is not None:
            base.watch(group, target.group(group))
        base.victim_pid = target.member_pid(tp_rank, pp_rank, base.group)
        return _signal(base.victim_pid, signum)

    return prepare


def signal_kind(kind: str, signum: int) -> Callable[[Target, Baseline], Action]:
    def prepare(target: Target, base: Baseline) -> Action:
        base.victim_pid = target.pid(kind)
        return _signal(base.victim_pid, signum)

    return prepare


def kill_embedded_valkey(target: Target, base: Baseline) -> Action:
    pid = target.valkey_pid()
    assert pid is not None, "no embedded Valkey found among pagemesh up's children"
    base.victim_pid = pid
    return _signal(pid, signal.SIGKILL)


def kill_external_redis(target: Target, base: Baseline) -> Action:
    """SIGKILL the external Valkey, and start it again (empty) a second later, as its own
    supervisor would."""
    assert target.valkey is not None
    valkey = target.valkey

    def action() -> None:
        os.kill(valkey.pid, signal.SIGKILL)
        time.sleep(1.0)
        valkey.start()

    return action


def partition_host(role: str) -> Callable[[Target, Baseline], Action]:
    """Cuts the host of the process `role` off the network (a netns target's)."""

    def prepare(target: Target, base: Baseline) -> Action:
        base.victim_pid, base.victim_host = target.processes[role].pid, role
        return target.hosts[role].partition

    return prepare


partition_worker = partition_host("w1")


def heal_and_see_it_leave(target: Target, base: Baseline) -> None:
    """Back on the network, the cut-off worker finds itself fenced and exits."""
    target.hosts[base.victim_host].heal()
    deadline = time.monotonic() + 30
    while target.processes[base.victim_host].poll() is None:
        assert time.monotonic() < deadline, "the partitioned worker did not leave once fenced"
        time.sleep(0.2)


LONG_PROMPTS = 4  # at once: one 7k prompt stayed under the old 0.3 s bound on a 2-core Xeon


def long_prefill(target: Target, base: Baseline) -> Action:
    """Four 7,000-token prompts at once, prefilled in one step (no chunking, a token budget
    that holds them all): a step far longer than the watchdog's bound, on healthy workers.
    Returns when they are done."""
    from bench.faults.workload import Clients, RequestSpec

    def action() -> None:
        specs = [
            [
                RequestSpec(
                    f"long-prefill-{n}", [(i * 7 + n) % 499 + 1 for i in range(7000)], 4, None
                )
            ]
            for n in range(LONG_PROMPTS)
        ]
        clients = Clients(target.address)
        try:
            results = clients.run(specs).results
        finally:
            clients.close()
        for result in results:
            assert result.error is None and len(result.token_ids) == 4, result.error

    return action


def no_alarm(target: Target, base: Baseline) -> None:
    """No recovery, and the long step was probed (its workers answered)."""
    deadline = time.monotonic() + 5  # the counters reach the registry with a heartbeat
    while True:
        group = target.group()
        assert group is not None and group.num_recoveries == base.recoveries, (
            "the watchdog declared a healthy long step hung"
        )
        if group.num_slow_steps > base.slow_steps:
            return
        assert time.monotonic() < deadline, "no step ran past the watchdog's bound"
        time.sleep(0.2)
