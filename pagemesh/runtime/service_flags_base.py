"""What a service option is: `ServiceFlag`, one option's declaration (name, type, default, help,
choices, which services take it, whether it is a secret), and the names of the services.

The declarations themselves are in service_flags_shared, service_flags_router,
service_flags_scheduler and service_flags_worker; pagemesh.runtime.service_flags puts them
together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROUTER = "router"
SCHEDULER = "scheduler"
WORKER = "worker"
SERVICES = (ROUTER, SCHEDULER, WORKER)

_FLAG_TYPES = (str, int, float, bool)


@dataclass(frozen=True)
class ServiceFlag:
    """One option: `--name` on every service in `services`, and once on `pagemesh up`."""

    name: str  # "--max-num-seqs"
    services: tuple[str, ...]
    help: str
    type: type = str  # str, int, float, or bool (given as --name / --no-name)
    default: Any = None  # None: not given on the command line (the service decides)
    choices: tuple[str, ...] | None = None
    repeatable: bool = False  # given once per item; the value is a list
    # A credential: `pagemesh up` hands it to its children in the environment (`env`), never
    # on a command line (every user of a host reads /proc/*/cmdline), and logs redact it.
    secret: bool = False

    def __post_init__(self) -> None:
        if not self.name.startswith("--"):
            raise ValueError(f"a flag name starts with --: {self.name!r}")
        if not self.services or set(self.services) - set(SERVICES):
            raise ValueError(f"{self.name}: services must be among {SERVICES}: {self.services}")
        if self.type not in _FLAG_TYPES:
            raise ValueError(f"{self.name}: type must be one of {_FLAG_TYPES}")
        if (
            self.choices is not None
            and self.default is not None
            and self.default not in self.choices
        ):
            raise ValueError(f"{self.name}: default {self.default!r} not in {self.choices}")
        if self.type is bool and (self.choices or self.repeatable):
            raise ValueError(f"{self.name}: a bool flag takes no choices and no repeats")

    @property
    def dest(self) -> str:
        """The attribute argparse stores it under: `--max-num-seqs` -> `max_num_seqs`."""
        return self.name[2:].replace("-", "_")

    @property
    def env(self) -> str:
        """The variable a service reads this flag's default from
        (pagemesh.runtime.config.add_flag)."""
        return "PAGEMESH_" + self.dest.upper()

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this flag `value`; none for None (the default)
        or for a secret (it travels in the environment: `options_env`)."""
        if value is None or self.secret:
            return []
        if self.type is bool:
            return [self.name if value else f"--no-{self.name[2:]}"]
        if self.repeatable:
            return [word for item in value for word in (self.name, str(item))]
        return [self.name, str(value)]
