"""A worker's host KV tier file (worker_svc/host_tier.py) seen from outside the worker: its
epoch, and damage done to it as a stray write would do it — random bytes over the data of
the slots that hold blocks, their headers (key, checksum, generation) left as they were,
so that only the checksum can tell."""

from __future__ import annotations

import os
import random


def tier_epoch(path: str) -> int:
    """The epoch in the file's header: a new file (or one reset) has a new one."""
    # The file's layout is the worker's to define: read with its own structs (imported
    # here, not with this module: they bring torch).
    from worker_svc.host_tier import _FILE_HEADER

    with open(path, "rb") as file:
        return _FILE_HEADER.unpack(file.read(_FILE_HEADER.size))[3]


def damage_sealed_slots(path: str, num_bytes: int = 4096, seed: int = 0) -> int:
    """Overwrites `num_bytes` (at most a block's) in the middle of the data of every sealed
    slot of the tier file at `path`; returns how many slots it damaged."""
    from worker_svc.host_tier import (
        _FILE_HEADER,
        _HEADER,
        FILE_HEADER_BYTES,
        SEALED,
        SLOT_HEADER_BYTES,
    )

    rng = random.Random(seed)
    fd = os.open(path, os.O_RDWR)
    try:
        (_, _, _, _, num_slots, bytes_per_block, slot_stride, data_offset, _) = _FILE_HEADER.unpack(
            os.pread(fd, _FILE_HEADER.size, 0)
        )
        table = os.pread(fd, num_slots * SLOT_HEADER_BYTES, FILE_HEADER_BYTES)
        num_bytes = min(num_bytes, bytes_per_block)
        sealed = [
            slot
            for slot in range(num_slots)
            if _HEADER.unpack_from(table, slot * SLOT_HEADER_BYTES)[1] == SEALED
        ]
        for slot in sealed:
            offset = data_offset + slot * slot_stride + (bytes_per_block - num_bytes) // 2
            os.pwrite(fd, rng.randbytes(num_bytes), offset)
    finally:
        os.close(fd)
    return len(sealed)
