"""What each service publishes in its registry entry, and the statuses in it: the contract
between the processes that write `<cluster>:<kind>:<id>` (pagemesh.runtime.registry) and every one
that reads it (the router's pool, group formation, `pagemesh top`, the benchmarks).

A writer builds an entry and publishes `entry.to_json()`; a reader gets one back from
`from_json`, which ignores keys it does not know (a newer writer) and fills the default of
every field a writer left out (an older one). Those defaults are the field defaults below and
live nowhere else. Pure: json-ready dicts, dataclasses and enums; no Redis, no gRPC.

Statuses are str-valued enums, so the JSON in Redis stays readable ("ready") and a status
compares equal to its string.
"""

from __future__ import annotations

import enum
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar


class WorkerStatus(enum.StrEnum):
    """A worker's place in its engine group (worker_svc/membership.py has the transitions)."""

    STANDBY = "standby"  # a --standby worker: no rank of its own until a plan gives it one
    JOINING = "joining"  # forming (or re-forming) its torch.distributed group
    LOADING = "loading"  # loading its shard of the model
    READY = "ready"  # executes steps


class GroupStatus(enum.StrEnum):
    """An engine group's health, as its scheduler publishes it (and GetStats answers)."""

    READY = "ready"  # every worker is up: routers send requests here
    DEGRADED = "degraded"  # a worker is missing and the group re-forms; requests queue
    DRAINING = "draining"  # shutting down: admits nothing


E = TypeVar("E", bound="ServiceEntry")


@dataclass(frozen=True)
class ServiceEntry:
    """The fields every service's entry has."""

    KIND: ClassVar[str]  # the `<kind>` of its key

    address: str = ""  # host:port of its gRPC server
    # The process behind the id, stamped by the Registry on every write (a restarted
    # container keeps its id but not its instance).
    instance: str = ""
    pid: int = -1
    host: str = ""  # hostname of the machine it runs on
    metrics_address: str | None = None  # host:port of its /metrics, None when not served
    # Wall-clock seconds of its last heartbeat and the TTL of its key, when the writer says
    # (no service does today); `pagemesh top` prefers them to the key's remaining TTL.
    heartbeat_at: float | None = None
    heartbeat_ttl_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object (a dict `json.dumps` can write); fields that are None are left out."""
        return {
            f.name: _plain(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }

    @classmethod
    def from_json(cls: type[E], raw: Mapping[str, Any]) -> E:
        """The entry a writer published. Unknown keys are ignored, missing ones (or null)
        take the field's default. Raises ValueError when a value has the wrong type or a
        status this version does not know."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"{cls.KIND} entry is not a JSON object: {raw!r}")
        hints = _field_types(cls)
        values = {}
        for f in fields(cls):
            if raw.get(f.name) is None:
                continue
            try:
                values[f.name] = _coerce(hints[f.name], raw[f.name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{cls.KIND} entry field {f.name}={raw[f.name]!r}: {exc}") from exc
        return cls(**values)


@dataclass(frozen=True)
class WorkerEntry(ServiceEntry):
    """A worker: where it serves, its place in the group layout and its counters."""

    KIND: ClassVar[str] = "worker"

    group: str = ""  # the engine group it belongs to
    model: str = ""  # the served model's name
    # host:port it reserved for the torch.distributed master, used when it gets rank 0.
    dist_addr: str = ""
    # Its place: a standby publishes ranks -1 until a plan gives it one. A worker that does
    # not say is a lone one (tp=pp=1, rank 0).
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # A worker that does not say is still starting: it may be given its slot, not steps.
    status: WorkerStatus = WorkerStatus.JOINING
    epoch: str = ""  # the rendezvous plan whose process group it is in, "" while in none
    num_reforms: int = 0  # process-group re-formations since it started
    quantization: str | None = None  # how its linear layers hold weights, once loaded
    weight_bytes: int | None = None  # its weights in memory, once loaded
    # Cumulative counters (steps, seconds) since the process started.
    num_steps: int = 0
    busy_time_s: float = 0.0
    tp_collective_time_s: float = 0.0
    tp_bytes_sent: int = 0  # in tensor-parallel collectives (worker_svc/distributed.py)
    pp_send_time_s: float = 0.0
    pp_recv_time_s: float = 0.0  # includes waiting for the previous stage
    # Memory once loaded (None: not said): its KV cache as allocated and its resident set.
    kv_cache_bytes: int | None = None
    rss_bytes: int | None = None


@dataclass(frozen=True)
class SchedulerEntry(ServiceEntry):
    """One engine group's scheduler: where it serves, the group's health and load."""

    KIND: ClassVar[str] = "scheduler"

    group: str = ""  # the engine group; "" means the scheduler id names it
    model: str = ""
    # Schedulers from before statuses existed published none: they were ready whenever
    # registered.
    status: GroupStatus = GroupStatus.READY
    members: tuple[str, ...] = ()  # worker ids, in (pp_rank, tp_rank) order
    # The step session it drives the members with, and their rendezvous epoch ("" for a
    # single worker): a worker takes a new session only when its scheduler's entry names
    # both (worker_svc/membership.py), so a replaced scheduler cannot drive it.
    session: str = ""
    epoch: str = ""
    num_recoveries: int = 0  # times the group was re-formed after a failure
    num_watchdog_probes: int = 0  # probes of the workers while a step ran long
    num_slow_steps: int = 0  # long steps whose workers all answered: slow, not hung
    num_steps: int = 0
    checkpoint_writes: int = 0  # request checkpoints written to Redis
    checkpoint_write_s: float = 0.0  # seconds spent writing them
    loras: tuple[str, ...] = ()  # the LoRA adapters a request may name here
    lora_version: int = 0  # bumped by every run-time load or unload of one
    lora_capacity: int = 0  # the adapters it may hold at once (0: it serves no LoRA)
    # The scheduler core's figures (scheduler_svc.core.config.SchedulerStats, field by
    # field; a test checks they agree).
    num_running: int = 0
    num_waiting: int = 0  # includes preempted and swapped requests
    num_free_blocks: int | None = None  # device KV blocks free; None: not said
    num_blocks: int = 0
    num_preemptions: int = 0
    num_swap_outs: int = 0
    num_swap_ins: int = 0
    num_swapped: int | None = None  # None: not said (`pagemesh top` asks the metrics)
    num_free_swap_blocks: int = 0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # of those, tokens found
    prefix_cache_hit_rate: float | None = None  # hits / queries; None: not said
    num_drafts: int = 0  # speculative decoding: drafts verified (a request's, in one step)
    num_draft_tokens: int = 0  # their tokens
    num_accepted_tokens: int = 0  # of those, the ones kept
    num_recomputed_tokens: int = 0  # resumed requests' tokens computed again, not pulled
    # Disaggregated serving: "prefill" (hands each new request off after its first
    # token), "decode" (where the router continues them), or "both" (colocated).
    role: str = "both"
    # KV moving between groups (scheduler_svc/kv_moves.py), since start. Held here for
    # another group: holds made, pulled, released unused, expired. Pulled from another:
    # imports tried, pulled, failed (recomputed), and the blocks and bytes pulled.
    kv_holds: int = 0
    kv_holds_pulled: int = 0
    kv_holds_unused: int = 0
    kv_holds_expired: int = 0
    kv_imports: int = 0
    kv_imports_pulled: int = 0
    kv_imports_failed: int = 0
    kv_blocks_pulled: int = 0
    kv_bytes_pulled: int = 0
    kv_tier_loads: int = 0  # of the imports pulled, those from the group's host tier

    def kv_cache_usage(self) -> float | None:
        """Fraction of the device KV blocks in use, 0..1; None when the entry does not say."""
        if self.num_blocks <= 0 or self.num_free_blocks is None:
            return None
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks


@dataclass(frozen=True)
class RouterEntry(ServiceEntry):
    """A router: where clients reach it and whether it serves."""

    KIND: ClassVar[str] = "router"

    serving: bool = False  # at least one engine group is ready
    num_groups: int = 0  # ready engine groups


ENTRY_TYPES: dict[str, type[ServiceEntry]] = {
    entry_type.KIND: entry_type for entry_type in (RouterEntry, SchedulerEntry, WorkerEntry)
}
KINDS = tuple(ENTRY_TYPES)  # ("router", "scheduler", "worker")


def entry_from_json(kind: str, raw: Mapping[str, Any]) -> ServiceEntry:
    """The entry of a `kind` service; ValueError for an unknown kind or a malformed entry."""
    if kind not in ENTRY_TYPES:
        raise ValueError(f"unknown service kind {kind!r}; known: {', '.join(KINDS)}")
    return ENTRY_TYPES[kind].from_json(raw)


@functools.cache
def _field_types(cls: type[ServiceEntry]) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(hint: Any, value: Any) -> Any:
    """`value` (from JSON) as the field type `hint`: a scalar, an enum, `X | None` or
    `tuple[str, ...]`."""
    args = typing.get_args(hint)
    if type(None) in args:  # X | None, and value is not None here
        (hint,) = (arg for arg in args if arg is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        if isinstance(value, (str, Mapping)):
            raise TypeError("expected a list")
        return tuple(_coerce(args[0], item) for item in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError("expected true or false")
        return value
    if hint in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError("expected a number")
    return hint(value)  # int, float, str, or an enum (ValueError for an unknown status)


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value
