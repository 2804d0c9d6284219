"""Test hosts on one machine: network namespaces joined by veth pairs to a bridge.

Every address lives in namespaces this code creates (and the bridge it creates in the
root namespace), so traffic never leaves the machine. Needs root and iproute2.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field


def run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str  # namespace name
    address: str  # its address on the test network
    interface: str  # its end of the veth pair, inside the namespace

    def argv(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]

    def partition(self) -> None:
        """Cuts the host off the network: its link goes down, its packets are dropped (no
        reset reaches anyone, as when a cable or a switch fails)."""
        run(*self.argv("ip", "link", "set", self.interface, "down"))

    def heal(self) -> None:
        """Back on the network, address and route as before."""
        run(*self.argv("ip", "link", "set", self.interface, "up"))


@dataclass
class HostNetwork:
    """A /24 on a bridge, one namespace per host; `close()` removes all of it."""

    prefix: str  # e.g. "10.213.77"
    tag: str = field(default_factory=lambda: f"{os.getpid() % 100000}")
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def bridge(self) -> str:
        return f"pmbr{self.tag}"

    def open(self) -> HostNetwork:
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{self.prefix}.254/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        return self

    def add_host(self, role: str) -> Host:
        index = len(self.hosts) + 1
        name, outside, inside = (
            f"pm{self.tag}{role}",
            f"pmv{self.tag}{index}",
            f"pmi{self.tag}{index}",
        )
        run("ip", "netns", "add", name)
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        run("ip", "link", "set", inside, "netns", name)
        run("ip", "link", "set", outside, "master", self.bridge)
        run("ip", "link", "set", outside, "up")
        address = f"{self.prefix}.{index}"
        run("ip", "netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", inside)
        run("ip", "netns", "exec", name, "ip", "link", "set", inside, "up")
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        host = Host(name, address, inside)
        self.hosts[role] = host
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"pmprobe{os.getpid() % 100000}"
    try:
        run("ip", "netns", "add", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns add` failed: {getattr(exc, 'stderr', exc)}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
