"""A host KV tier: KV blocks kept in a shared-memory file that outlives the worker process.

The file (under /dev/shm, one per rank: `tier_path`) is made by the host's supervisor or by
the first worker that opens it, and is never deleted by a worker: a worker killed with
SIGKILL and restarted on the same host maps the same file and finds the blocks there. The
scheduler decides which device block goes to which slot and keeps the index (content key ->
slot, with the file's `epoch`); the worker only moves bytes and checks them.

Layout (little-endian): a 512-byte file header (magic, format version, its own CRC, epoch,
slot count, bytes per block, layout fingerprint), then one 64-byte header per slot, then the
slots' data, each slot starting on a 4 KiB boundary. The slot headers sit in one table
rather than before each slot's data: the data stays page-aligned without a page of padding
per slot (25% of a small model's block), and an unwritten slot costs no memory (the file is
sparse). A slot's data is, for each local layer in order, `cache[:, block_id]` (K then V,
`[2, block_size, num_kv_heads, head_dim]`) contiguous.

Torn writes. A slot header holds a generation (odd while the slot is written), the key the
scheduler gave, the CRC-32 of the data, and a state. `store` makes the generation odd
before touching the data and makes it even only after the key and CRC are in, each as a
separate write, so a process killed at any instruction leaves the old sealed block with
its data untouched, an odd generation, or the new block sealed. A write is a prefix of program
order after
SIGKILL (the page cache keeps every store that retired), while the bytes inside one memcpy
land in no set order, hence the separate writes. `load` refuses a slot unless the generation
is even and the state sealed, the key is the expected one and the data's CRC is the stored
one, and refuses it again when the generation changed while it copied (a writer in another
process).

CRC-32 (zlib) over the slot's bytes: measured faster than Adler-32 (which is also weaker)
and far faster than SHA-1, BLAKE2b and MD5. It catches every error burst of up to
32 bits and misses other damage (a page of old or zeroed data) with probability 2^-32, where
a sum misses any reordering. It costs about as much as the slot copy itself: SmolLM2-135M
blocks (737,280 bytes) stored and loaded markedly slower with it than without (CPU caches,
warm /dev/shm pages; the first store into fresh pages is slower still, faulting them in).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterable

import torch

from worker_svc.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

MAGIC = b"PMKVTIER"
FORMAT_VERSION = 1
ALIGN_BYTES = 4096  # data alignment; a constant so the layout does not depend on the host
FILE_HEADER_BYTES = 512
SLOT_HEADER_BYTES = 64
KEY_BYTES = 32
FINGERPRINT_BYTES = 256
STAGING_BYTES = 64 << 20  # per staged copy of CUDA caches, on the device and pinned on the host

# magic, version, header CRC, epoch, num_slots, bytes_per_block, slot_stride, data_offset,
# fingerprint
_FILE_HEADER = struct.Struct(f"<8sIIQQQQQ{FINGERPRINT_BYTES}s")
_GENERATION = struct.Struct("<Q")  # slot header bytes 0..8
_STATE = struct.Struct("<I")  # bytes 8..12
_SEAL = struct.Struct(f"<II{KEY_BYTES}s")  # state, checksum, key: bytes 8..48
_HEADER = struct.Struct(f"<QII{KEY_BYTES}s")  # the whole slot header, for reading

EMPTY, WRITING, SEALED = 0, 1, 2
_NEW_FILE = "the file is new (empty)"


class HostTierBusy(RuntimeError):
    """The file must be reset (another layout, damaged) but another process has it open:
    truncating a file under a live mapping would kill that process with SIGBUS."""


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _checksum(data: memoryview) -> int:
    return zlib.crc32(data)


def _key_bytes(key: bytes) -> bytes:
    return bytes(key[:KEY_BYTES]).ljust(KEY_BYTES, b"\0")


def _needs_staging(device: torch.device) -> bool:
    """Caches off the host go through a gathered, pinned host buffer (one DMA per round of
    STAGING_BYTES); CPU caches are copied straight between the cache and the slot."""
    return device.type != "cpu"


class _Layout:
    """Where everything is in a tier file of `num_slots` slots for `spec`."""

    def __init__(self, spec: KVCacheSpec, num_slots: int, identity: str) -> None:
        if num_slots <= 0:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.spec = spec
        self.num_slots = num_slots
        self.bytes_per_block = spec.bytes_per_block
        self.slot_stride = _round_up(self.bytes_per_block, ALIGN_BYTES)
        self.data_offset = _round_up(FILE_HEADER_BYTES + num_slots * SLOT_HEADER_BYTES, ALIGN_BYTES)
        self.file_bytes = self.data_offset + num_slots * self.slot_stride
        self.fingerprint = _fingerprint(spec, identity)

    def header(self, epoch: int) -> bytes:
        fields = (
            MAGIC,
            FORMAT_VERSION,
            0,
            epoch,
            self.num_slots,
            self.bytes_per_block,
            self.slot_stride,
            self.data_offset,
            self.fingerprint,
        )
        crc = zlib.crc32(_FILE_HEADER.pack(*fields))
        return _FILE_HEADER.pack(*fields[:2], crc, *fields[3:])

    def problem(self, raw: bytes, file_bytes: int) -> tuple[int, str | None]:
        """(epoch, None) when `raw` is the header of a file of this layout, else (0, why not)."""
        if file_bytes != self.file_bytes:
            return 0, f"the file has {file_bytes} bytes, this layout needs {self.file_bytes}"
        if len(raw) < _FILE_HEADER.size:
            return 0, "the header is cut short"
        magic, version, crc, epoch, *sizes, fingerprint = _FILE_HEADER.unpack_from(raw)
        if magic != MAGIC or version != FORMAT_VERSION:
            return 0, f"magic {magic!r} version {version} is not {MAGIC!r} {FORMAT_VERSION}"
        if crc != zlib.crc32(raw[:12] + b"\0" * 4 + raw[16 : _FILE_HEADER.size]):
            return 0, "the header's checksum does not match"
        mine = [self.num_slots, self.bytes_per_block, self.slot_stride, self.data_offset]
        if sizes != mine or fingerprint != self.fingerprint:
            theirs = fingerprint.rstrip(b"\0").decode(errors="replace")
            return 0, f"made for {theirs} {sizes}, not {self.describe()} {mine}"
        return epoch, None

    def describe(self) -> str:
        return self.fingerprint.rstrip(b"\0").decode()


def _fingerprint(spec: KVCacheSpec, identity: str) -> bytes:
    text = (
        f"{str(spec.dtype).removeprefix('torch.')}/layers={spec.num_layers}/"
        f"block_size={spec.block_size}/kv_heads={spec.num_kv_heads}/head_dim={spec.head_dim}"
    )
    if identity:
        text += f"/{identity}"
    raw = text.encode()
    if len(raw) > FINGERPRINT_BYTES:
        raw = f"sha256:{hashlib.sha256(raw).hexdigest()}".encode()
    return raw.ljust(FINGERPRINT_BYTES, b"\0")


def _claim(fd: int, path: str, layout: _Layout) -> int:
    """Returns the file's epoch, resetting the file first when it does not hold this layout,
    and leaves a shared lock on it for as long as it is open. Only a process that holds the
    file alone (an exclusive lock) may reset it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits out another opener's check or reset
        epoch, problem = _read_header(fd, layout)
        if problem is not None:
            raise HostTierBusy(f"{path} is open in another process and {problem}") from None
        return epoch
    epoch, problem = _read_header(fd, layout)
    if problem is not None:
        epoch = _reset(fd, layout)
        level = logging.INFO if problem == _NEW_FILE else logging.WARNING
        logger.log(level, "host KV tier %s reset, epoch now %#x: %s", path, epoch, problem)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return epoch


def _read_header(fd: int, layout: _Layout) -> tuple[int, str | None]:
    file_bytes = os.fstat(fd).st_size
    if file_bytes == 0:
        return 0, _NEW_FILE
    return layout.problem(os.pread(fd, FILE_HEADER_BYTES, 0), file_bytes)


def _reset(fd: int, layout: _Layout) -> int:
    """Forgets everything: truncating drops every page, the regrown file reads as zeros (all
    slots empty), and the header is written last, so a reset cut short is reset again."""
    epoch = int.from_bytes(os.urandom(8), "little") or 1
    os.ftruncate(fd, 0)
    os.ftruncate(fd, layout.file_bytes)
    os.pwrite(fd, layout.header(epoch), 0)
    return epoch


def _warn_if_unbacked(fd: int, path: str, layout: _Layout) -> None:
    """The file is sparse, so its size is not reserved: a write to a new page once the
    filesystem (a tmpfs sized at half the RAM by default) is full kills this process with
    SIGBUS. Reserving it all up front would cost the memory before any block is stored."""
    fs = os.fstatvfs(fd)
    room = fs.f_bavail * fs.f_frsize + os.fstat(fd).st_blocks * 512
    if room < layout.file_bytes:
        logger.warning(
            "host KV tier %s has %d bytes but its filesystem has room for %d: a "
            "store past that point will crash the worker (SIGBUS); use fewer slots",
            path,
            layout.file_bytes,
            room,
        )


def _open_file(path: str) -> int:
    """The tier file, created if missing; a link or a file of another owner is refused
    because /dev/shm is writable by every user."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"{path} is not a regular file of this user")
    return fd


class HostTier:
    """One rank's host KV tier, mapped shared. Not thread-safe: one thread stores and loads.

    Slots are `0 <= slot < num_slots`; block ids index dimension 1 of the caches (one
    `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per local layer)."""

    def __init__(self, path: str, fd: int, mapping: mmap.mmap, layout: _Layout, epoch: int) -> None:
        self.path = path
        self.spec = layout.spec
        self.num_slots = layout.num_slots
        self._fd = fd
        self._map = mapping
        self._layout = layout
        self._epoch = epoch
        self._view = memoryview(mapping)
        spec = layout.spec
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=layout.data_offset)
        data = data.view(layout.num_slots, layout.slot_stride)[:, : layout.bytes_per_block]
        # [num_slots, num_layers, 2, block_size, num_kv_heads, head_dim], no copy.
        self._blocks = data.view(spec.dtype).unflatten(
            1, (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
        )
        self._staging: torch.Tensor | None = None

    @classmethod
    def open(cls, path: str, spec: KVCacheSpec, num_slots: int, *, identity: str = "") -> HostTier:
        """Maps the tier file at `path`, creating it, or resetting it with a new epoch when it
        was made for another layout or size or is damaged. `identity` names what else the
        KV depends on (the model and its revision, the rank's layer and KV-head range): a
        file written for another identity is reset rather than read."""
        layout = _Layout(spec, num_slots, identity)
        fd = _open_file(path)
        try:
            epoch = _claim(fd, path, layout)
            _warn_if_unbacked(fd, path, layout)
            mapping = mmap.mmap(
                fd, layout.file_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, mapping, layout, epoch)

    @property
    def epoch(self) -> int:
        """Random 64-bit id of this incarnation of the file; the scheduler drops its index
        when the epoch differs from the one it indexed (the tier was lost or re-created)."""
        return self._epoch

    def close(self) -> None:
        """Unmaps and releases the lock; the file and its blocks stay."""
        if self._fd < 0:
            return
        self._view.release()
        self._blocks = self._staging = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            logger.warning("host KV tier %s still viewed at close; left to unmap later", self.path)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def store(self, caches: list[torch.Tensor], pairs: list[tuple[int, int, bytes]]) -> None:
        """For each (device block id, slot, key): copies the block's K and V of every local
        layer into the slot and seals it under `key` (opaque, padded or cut to 32 bytes)."""
        self._check_open()
        if not pairs:
            return
        self._check_caches(caches)
        self._check_ids([s for _, s, _ in pairs], self.num_slots, "slot")
        self._check_ids([b for b, _, _ in pairs], caches[0].shape[1], "block id", unique=False)
        staged = _needs_staging(caches[0].device)
        step = self._staging_blocks() if staged else len(pairs)
        for start in range(0, len(pairs), step):
            chunk = pairs[start : start + step]
            block_ids = [b for b, _, _ in chunk]
            if staged:
                fill = self._staged_source(caches, block_ids)
            else:
                fill = _direct_source(caches, block_ids)
            for i, (_, slot, key) in enumerate(chunk):
                self._begin_write(slot)
                fill(i, self._blocks[slot])
                self._seal(slot, key)

    def load(self, caches: list[torch.Tensor], triples: list[tuple[int, int, bytes]]) -> list[int]:
        """For each (slot, device block id, expected key): copies the slot into the block when
        it verifies. Returns the block ids that failed, in the order given: a slot refused
        before the copy leaves its block unchanged; one whose generation changed during the
        copy (a writer in another process) leaves garbage in a CPU cache's block."""
        self._check_open()
        if not triples:
            return []
        self._check_caches(caches)
        self._check_ids([s for s, _, _ in triples], self.num_slots, "slot", unique=False)
        self._check_ids([b for _, b, _ in triples], caches[0].shape[1], "block id")
        verified = []
        for slot, block, key in triples:
            generation = self._verified_generation(slot, key)
            if generation is not None:
                verified.append((slot, block, generation))
        if not _needs_staging(caches[0].device):
            loaded = self._load_direct(caches, verified)
        else:
            step = self._staging_blocks()
            loaded = set().union(
                *(
                    self._load_staged(caches, verified[i : i + step])
                    for i in range(0, len(verified), step)
                )
            )
        return [b for _, b, _ in triples if b not in loaded]

    def invalidate(self, slots: Iterable[int]) -> None:
        """Marks slots empty (the scheduler evicted them): their next load fails."""
        self._check_open()
        slots = list(slots)
        self._check_ids(slots, self.num_slots, "slot", unique=False)
        for slot in slots:
            offset = self._header_offset(slot)
            _STATE.pack_into(self._map, offset + 8, EMPTY)  # refused from here on
            _SEAL.pack_into(self._map, offset + 8, EMPTY, 0, b"")
            _GENERATION.pack_into(self._map, offset, (self._generation(slot) | 1) + 1)

    # The steps of a store, separate so that tests can stop between them as a kill would.

    def _begin_write(self, slot: int) -> None:
        offset = self._header_offset(slot)
        _GENERATION.pack_into(self._map, offset, self._generation(slot) | 1)
        _SEAL.pack_into(self._map, offset + 8, WRITING, 0, b"")

    def _seal(self, slot: int, key: bytes) -> None:
        offset = self._header_offset(slot)
        checksum = _checksum(self._slot_bytes(slot))
        _SEAL.pack_into(self._map, offset + 8, SEALED, checksum, _key_bytes(key))
        _GENERATION.pack_into(self._map, offset, self._generation(slot) + 1)

    def _verified_generation(self, slot: int, key: bytes) -> int | None:
        """The slot's generation when it holds a sealed block under `key` whose data checks,
        else None."""
        generation, state, checksum, stored_key = _HEADER.unpack_from(
            self._map, self._header_offset(slot)
        )
        if generation % 2 or state != SEALED or stored_key != _key_bytes(key):
            return None
        if _checksum(self._slot_bytes(slot)) != checksum:
            logger.warning("host KV tier %s: slot %d fails its checksum", self.path, slot)
            return None
        return generation

    def _load_direct(
        self, caches: list[torch.Tensor], verified: list[tuple[int, int, int]]
    ) -> set[int]:
        loaded = set()
        for slot, block, generation in verified:
            torch.unbind_copy(self._blocks[slot], 0, out=[c.select(1, block) for c in caches])
            if self._generation(slot) == generation:
                loaded.add(block)
        return loaded

    def _load_staged(
        self, caches: list[torch.Tensor], verified: list[tuple[int, int, int]]
    ) -> set[int]:
        """Slots -> pinned host buffer (re-checked there, so a slot changed mid-copy never
        reaches the device) -> device in one copy -> each layer's blocks by one index_copy_."""
        host = self._host_staging(len(verified))
        kept: list[int] = []
        for slot, block, generation in verified:
            host[len(kept)].copy_(self._blocks[slot])
            if self._generation(slot) == generation:
                kept.append(block)
        if not kept:
            return set()
        device = caches[0].device
        staged = host[: len(kept)].to(device)  # blocking: the host buffer is reused next call
        index = torch.tensor(kept, device=device)
        for layer, cache in enumerate(caches):
            cache.index_copy_(1, index, staged[:, layer].transpose(0, 1))
        return set(kept)

    def _staged_source(
        self, caches: list[torch.Tensor], block_ids: list[int]
    ) -> Callable[[int, torch.Tensor], None]:
        """One gather per layer on the device into `[n, num_layers, 2, ...]`, one copy to a
        pinned host buffer, then each block is one contiguous copy into its slot."""
        device = caches[0].device
        index = torch.tensor(block_ids, device=device)
        gathered = torch.empty(
            (len(block_ids), *self._blocks.shape[1:]), dtype=self.spec.dtype, device=device
        )
        for layer, cache in enumerate(caches):
            gathered[:, layer] = cache.index_select(1, index).transpose(0, 1)
        host = self._host_staging(len(block_ids))
        host.copy_(gathered)
        return lambda i, out: out.copy_(host[i])

    def _staging_blocks(self) -> int:
        """Blocks per staged copy: bounds the device gather buffer and the pinned host
        buffer to STAGING_BYTES, as a KV cache leaves little device memory free."""
        return max(1, STAGING_BYTES // self._layout.bytes_per_block)

    def _host_staging(self, num_blocks: int) -> torch.Tensor:
        """`[num_blocks, num_layers, 2, ...]` on the host, pinned when CUDA is there; grown
        as needed and kept, because pinning memory costs milliseconds per call."""
        shape = self._blocks.shape[1:]
        if self._staging is None or self._staging.shape[0] < num_blocks:
            self._staging = torch.empty(
                (num_blocks, *shape), dtype=self.spec.dtype, pin_memory=torch.cuda.is_available()
            )
        return self._staging[:num_blocks]

    def _check_open(self) -> None:
        if self._fd < 0:
            raise ValueError(f"host KV tier {self.path} is closed")

    def _check_caches(self, caches: list[torch.Tensor]) -> None:
        spec = self.spec
        if len(caches) != spec.num_layers:
            raise ValueError(f"{len(caches)} cache tensors for a tier of {spec.num_layers} layers")
        for cache in caches:
            if (
                cache.dim() != 5
                or cache.shape[0] != 2
                or cache.dtype != spec.dtype
                or tuple(cache.shape[2:]) != (spec.block_size, spec.num_kv_heads, spec.head_dim)
            ):
                raise ValueError(
                    f"a cache tensor {tuple(cache.shape)} {cache.dtype} does not "
                    f"match the tier's {spec}"
                )
            if cache.shape[1] != caches[0].shape[1] or cache.device != caches[0].device:
                raise ValueError("every layer's cache must have as many blocks, on one device")

    @staticmethod
    def _check_ids(ids: list[int], limit: int, what: str, unique: bool = True) -> None:
        outside = [i for i in ids if not 0 <= i < limit]
        if outside:
            raise ValueError(f"{what}s {outside[:8]} are outside [0, {limit})")
        if unique and len(set(ids)) != len(ids):
            raise ValueError(f"a {what} appears twice in one call")

    def _header_offset(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * SLOT_HEADER_BYTES

    def _generation(self, slot: int) -> int:
        return _GENERATION.unpack_from(self._map, self._header_offset(slot))[0]

    def _slot_bytes(self, slot: int) -> memoryview:
        start = self._layout.data_offset + slot * self._layout.slot_stride
        return self._view[start : start + self._layout.bytes_per_block]


def _direct_source(
    caches: list[torch.Tensor], block_ids: list[int]
) -> Callable[[int, torch.Tensor], None]:
    """Each block's layers stacked straight into its slot: one torch call per block
    (measured faster than a copy_ per layer or a gather per layer, on SmolLM blocks)."""

    def fill(i: int, out: torch.Tensor) -> None:
        torch.stack([cache.select(1, block_ids[i]) for cache in caches], out=out)

    return fill
