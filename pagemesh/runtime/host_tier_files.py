"""Where the workers' host KV tiers live (worker_svc/host_tier.py): one file per rank in
shared memory, named by cluster, group and rank so that a restarted worker finds its
predecessor's. Here, not in the worker, because `pagemesh up` (the host's supervisor)
removes its mesh's files when it stops, and services import `pagemesh`, not the reverse.
"""

from __future__ import annotations

import hashlib
import os
import re

FILE_PREFIX = "pagemesh-kvtier"


def tier_path(directory: str, cluster: str, group: str, pp_rank: int, tp_rank: int) -> str:
    """The tier file of one rank: `<directory>/pagemesh-kvtier.<cluster>.<group>.pp<i>.tp<j>`.
    Parts are reduced to `[A-Za-z0-9_-]`; a part that had to change gets a hash of its
    original, so two clusters or groups never share a file."""
    if pp_rank < 0 or tp_rank < 0:
        raise ValueError(f"ranks must be non-negative, got pp {pp_rank} tp {tp_rank}")
    name = f"{_cluster_prefix(cluster)}{_safe_part(group)}.pp{pp_rank}.tp{tp_rank}"
    return os.path.join(directory, name)


def remove_tier_files(directory: str, cluster: str) -> list[str]:
    """Deletes `cluster`'s tier files in `directory` (the supervisor, at shutdown) and
    returns their paths. A worker that still maps one keeps its memory until it unmaps."""
    prefix = _cluster_prefix(cluster)
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in sorted(names):
        if name.startswith(prefix):
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)
    return removed


def _cluster_prefix(cluster: str) -> str:
    return f"{FILE_PREFIX}.{_safe_part(cluster)}."


def _safe_part(part: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", part):
        return part
    digest = hashlib.sha256(part.encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', part)[:48]}-{digest}"
