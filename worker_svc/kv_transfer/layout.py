"""Which part of the model's KV one rank holds, and which source rank a destination rank
pulls each part from.

A rank of an engine group holds a rectangle of the model's KV: the decoder layers of its
pipeline stage times the KV heads of its tensor-parallel shard (several ranks hold the same
head when heads are replicated). Groups of one model may be laid out differently (TP 2 x
PP 1 here, TP 1 x PP 2 there), so a destination rank's rectangle is cut into pieces, each
pulled from one source rank that holds it. Pure Python: no torch (`slice_for_rank` asks
the model's sharding code), no I/O but `host_key`'s reads of /proc.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from typing import NamedTuple

from worker_svc.parallel import ParallelConfig


class TransferError(Exception):
    """A KV transfer that cannot happen as asked; `str()` is the reason, for a person."""


@dataclass(frozen=True)
class RankSlice:
    """The KV one rank holds: global layers [layer_start, layer_stop) and global KV heads
    [kv_head_start, kv_head_stop), in blocks of `block_size` tokens of `head_dim` elements
    of `dtype` (torch's name without the prefix: "float32", "bfloat16"). `address` is
    "host:port" of that rank's transfer server; `host_key` says which host and network
    namespace it runs in (`host_key()`): shared memory is used only where they match."""

    layer_start: int
    num_layers: int
    kv_head_start: int
    num_kv_heads: int
    block_size: int  # tokens per block
    head_dim: int  # elements per head
    dtype: str
    address: str = ""
    host_key: str = ""

    def __post_init__(self) -> None:
        if self.layer_start < 0 or self.kv_head_start < 0:
            raise ValueError(f"layer_start and kv_head_start must be >= 0: {self}")
        if min(self.num_layers, self.num_kv_heads, self.block_size, self.head_dim) <= 0:
            raise ValueError(f"every KV dimension of a rank slice must be positive: {self}")

    @property
    def layer_stop(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def kv_head_stop(self) -> int:
        return self.kv_head_start + self.num_kv_heads

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)

    @property
    def kv_heads(self) -> range:
        return range(self.kv_head_start, self.kv_head_stop)

    def holds(self, layers: range, kv_heads: range) -> bool:
        """Whether every (layer, head) of the rectangle is in this slice."""
        return (
            self.layer_start <= layers.start
            and layers.stop <= self.layer_stop
            and self.kv_head_start <= kv_heads.start
            and kv_heads.stop <= self.kv_head_stop
        )

    def overlap(self, other: RankSlice) -> tuple[range, range]:
        """(layers, kv heads) both slices hold; either range is empty when they share none."""
        return (_intersect(self.layers, other.layers), _intersect(self.kv_heads, other.kv_heads))

    def describe(self) -> str:
        """ "127.0.0.1:4100 (layers 0-14, kv heads 2-3)" for reasons and logs."""
        return (
            f"{self.address or '?'} (layers {_span(self.layers)}, kv heads {_span(self.kv_heads)})"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RankSlice:
        return cls(**json.loads(text))


class PullPiece(NamedTuple):
    """One request of a pull: these global layers and KV heads, from this source rank."""

    source: RankSlice
    layers: range
    kv_heads: range


def plan_pull(mine: RankSlice, sources: list[RankSlice]) -> list[PullPiece]:
    """Pieces that together cover every (layer, KV head) cell of `mine` exactly once, each
    from a source rank holding it, using as few source ranks as a greedy cover finds (any
    holder of a replicated head will do). Raises TransferError when the sources' KV has
    another block size, head size or dtype, or when some cell of `mine` is on no source."""
    if not sources:
        raise TransferError(f"no source ranks to pull {mine.describe()} from")
    _check_compatible(mine, sources)
    cells = _cells(mine, sources)
    holders = {cell: [i for i, s in enumerate(sources) if s.holds(*cell)] for cell in cells}
    missing = [cell for cell, who in holders.items() if not who]
    if missing:
        held = ", ".join(s.describe() for s in sources)
        gaps = ", ".join(f"layers {_span(l)} x kv heads {_span(h)}" for l, h in missing)
        raise TransferError(
            f"the source group does not hold all of this rank's KV: no "
            f"source has {gaps} (sources: {held})"
        )
    owner = _greedy_cover(cells, holders)
    pieces = [
        PullPiece(sources[i], layers, heads)
        for i in sorted(set(owner.values()))
        for layers, heads in _merge([cell for cell, o in owner.items() if o == i])
    ]
    return sorted(pieces, key=lambda p: (p.layers.start, p.kv_heads.start))


def _check_compatible(mine: RankSlice, sources: list[RankSlice]) -> None:
    for field, unit in (
        ("dtype", ""),
        ("block_size", " tokens per block"),
        ("head_dim", " elements per head"),
    ):
        theirs = {getattr(s, field) for s in sources}
        if len(theirs) > 1:
            raise TransferError(f"the source ranks disagree on {field}: {sorted(theirs)}")
        (value,) = theirs
        if value != getattr(mine, field):
            raise TransferError(
                f"the source group's KV is {value}{unit}, this group's {getattr(mine, field)}"
                f"{unit}: KV blocks move only between groups of the same {field}; the "
                "request must recompute its KV here"
            )


def _cells(mine: RankSlice, sources: list[RankSlice]) -> list[tuple[range, range]]:
    """`mine` cut along every source boundary: each cell is wholly in or out of each source."""
    layer_cuts = _cuts(mine.layers, [s.layers for s in sources])
    head_cuts = _cuts(mine.kv_heads, [s.kv_heads for s in sources])
    return [
        (range(l0, l1), range(h0, h1))
        for l0, l1 in zip(layer_cuts, layer_cuts[1:])
        for h0, h1 in zip(head_cuts, head_cuts[1:])
    ]


def _cuts(span: range, others: list[range]) -> list[int]:
    points = {span.start, span.stop}
    for other in others:
        points.update(p for p in (other.start, other.stop) if span.start < p < span.stop)
    return sorted(points)


def _greedy_cover(
    cells: list[tuple[range, range]], holders: dict[tuple[range, range], list[int]]
) -> dict[tuple[range, range], int]:
    """Cell -> source index: repeatedly the source holding the most uncovered cells (by
    area; the earlier source on a tie) takes all of them."""
    owner: dict[tuple[range, range], int] = {}
    candidates = sorted({i for who in holders.values() for i in who})
    while len(owner) < len(cells):
        uncovered = [cell for cell in cells if cell not in owner]
        best = max(
            candidates,
            key=lambda i: (sum(len(l) * len(h) for l, h in uncovered if i in holders[(l, h)]), -i),
        )
        for cell in uncovered:
            if best in holders[cell]:
                owner[cell] = best
    return owner


def _merge(cells: list[tuple[range, range]]) -> list[tuple[range, range]]:
    """Adjacent cells joined into as few rectangles as a row-then-column sweep finds."""
    rows: list[tuple[range, range]] = []
    for layers, heads in sorted(cells, key=lambda c: (c[0].start, c[1].start)):
        if rows and rows[-1][0] == layers and rows[-1][1].stop == heads.start:
            rows[-1] = (layers, range(rows[-1][1].start, heads.stop))
        else:
            rows.append((layers, heads))
    merged: list[tuple[range, range]] = []
    for layers, heads in sorted(rows, key=lambda c: (c[1].start, c[1].stop, c[0].start)):
        if merged and merged[-1][1] == heads and merged[-1][0].stop == layers.start:
            merged[-1] = (range(merged[-1][0].start, layers.stop), heads)
        else:
            merged.append((layers, heads))
    return merged


def _intersect(a: range, b: range) -> range:
    start, stop = max(a.start, b.start), min(a.stop, b.stop)
    return range(start, max(start, stop))


def _span(r: range) -> str:
    return f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}"


def host_key() -> str:
    """This host and network namespace: hostname, boot id and the inode of this process's
    network namespace. Two processes with equal keys may share /dev/shm; a pair split by
    network namespaces (a partition test, two containers) gets different keys, so its KV
    goes over TCP as between hosts. A part that cannot be read becomes this process's id,
    which matches no other process: shared memory is then never assumed."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot_id = handle.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"{socket.gethostname()}/pid-{os.getpid()}"
    return f"{socket.gethostname()}/{boot_id}/netns-{netns}"


def slice_for_rank(
    parallel: ParallelConfig,
    *,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: str,
    address: str = "",
    key: str = "",
) -> RankSlice:
    """The RankSlice of the rank that `parallel` places in a model of `num_layers` decoder
    layers with `num_heads` query and `num_kv_heads` KV heads: the split the model's loader
    makes (`ParallelConfig.layer_range`, `attention_shard`). `key` is its host key."""
    from worker_svc.model.parallel_layers import attention_shard

    layers = parallel.layer_range(num_layers)
    shard = attention_shard(num_heads, num_kv_heads, parallel.tp_size, parallel.tp_rank)
    return RankSlice(
        layers.start,
        len(layers),
        shard.kv_head_start,
        shard.num_kv_heads,
        block_size,
        head_dim,
        dtype,
        address,
        key,
    )
