"""The host KV tier keeps blocks across a worker's death and never hands back a torn one."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pagemesh.runtime.host_tier_files import remove_tier_files, tier_path
from worker_svc import host_tier
from worker_svc.host_tier import (
    FILE_HEADER_BYTES,
    SLOT_HEADER_BYTES,
    WRITING,
    HostTier,
    HostTierBusy,
)
from worker_svc.kv_cache import KVCacheSpec

ROOT = Path(__file__).resolve().parents[2]
SPEC = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
# 64 KiB blocks: a SIGKILL lands inside a store's copy or checksum most of the time.
KILL_SPEC = KVCacheSpec(
    num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32
)
KILL_BLOCKS, KILL_SLOTS = 16, 7


def make_caches(spec: KVCacheSpec, num_blocks: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.randn(shape, generator=generator).to(spec.dtype) for _ in range(spec.num_layers)]


def zero_caches(spec: KVCacheSpec, num_blocks: int) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype) for _ in range(spec.num_layers)]


def key(n: int) -> bytes:
    return hashlib.sha256(f"block {n}".encode()).digest()


def block_bits(caches: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """The block's bytes, so that equality is bit-identity, not float equality."""
    return [cache[:, block].contiguous().view(torch.uint8) for cache in caches]


def same_block(a: list[torch.Tensor], block_a: int, b: list[torch.Tensor], block_b: int) -> bool:
    return all(torch.equal(x, y) for x, y in zip(block_bits(a, block_a), block_bits(b, block_b)))


def run_child(*args: str) -> subprocess.Popen[str]:
    """This module's `child_main` in a fresh interpreter: another process, as a restarted
    worker is."""
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        "import test_host_tier; test_host_tier.child_main(sys.argv[1:])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def child_main(argv: list[str]) -> None:
    """`store PATH`: stores blocks 5, 0, 9 of seed 1 into slots 3, 7, 0, prints the epoch and
    dies without closing. `store-forever PATH`: stores the 16 blocks round-robin into 7 slots
    until killed, having printed `ready`."""
    mode, path = argv
    if mode == "store":
        tier = HostTier.open(path, SPEC, 8)
        tier.store(make_caches(SPEC, 10, seed=1), [(5, 3, key(5)), (0, 7, key(0)), (9, 0, key(9))])
        print(tier.epoch, flush=True)
        os._exit(0)
    tier = HostTier.open(path, KILL_SPEC, KILL_SLOTS)
    caches = make_caches(KILL_SPEC, KILL_BLOCKS, seed=2)
    print("ready", flush=True)
    i = 0
    while True:
        block = i % KILL_BLOCKS
        tier.store(caches, [(block, i % KILL_SLOTS, key(block))])
        i += 1


@pytest.fixture(params=["direct", "staged", "staged-in-rounds"])
def path_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`staged` sends CPU caches through the gather-and-stage path that CUDA caches take;
    `staged-in-rounds` stages one fp32 block (two bf16 blocks) at a time, so three blocks
    take several rounds."""
    if request.param != "direct":
        monkeypatch.setattr(host_tier, "_needs_staging", lambda device: True)
    if request.param == "staged-in-rounds":
        monkeypatch.setattr(host_tier, "STAGING_BYTES", SPEC.bytes_per_block + 1)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_then_load_is_bit_identical(
    tmp_path: Path, dtype: torch.dtype, path_kind: str
) -> None:
    spec = KVCacheSpec(3, 4, 2, 8, dtype)
    source = make_caches(spec, 10, seed=1)
    with HostTier.open(str(tmp_path / "tier"), spec, 8) as tier:
        tier.store(source, [(5, 3, key(5)), (0, 7, key(0)), (9, 0, key(9))])
        target = zero_caches(spec, 12)
        failed = tier.load(target, [(0, 1, key(9)), (3, 11, key(5)), (7, 2, key(0))])
    assert failed == []
    assert same_block(target, 1, source, 9)
    assert same_block(target, 11, source, 5)
    assert same_block(target, 2, source, 0)
    untouched = zero_caches(spec, 12)
    assert all(same_block(target, b, untouched, b) for b in range(12) if b not in (1, 2, 11))


def test_restarted_process_finds_the_blocks_and_the_epoch(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    child = run_child("store", path)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    with HostTier.open(path, SPEC, 8) as tier:
        assert tier.epoch == int(out)
        target = zero_caches(SPEC, 10)
        assert tier.load(target, [(3, 0, key(5)), (7, 1, key(0)), (0, 2, key(9))]) == []
    source = make_caches(SPEC, 10, seed=1)
    assert all(same_block(target, b, source, s) for b, s in [(0, 5), (1, 0), (2, 9)])


def stored_one_block(path: str, spec: KVCacheSpec = SPEC, identity: str = "") -> int:
    with HostTier.open(path, spec, 8, identity=identity) as tier:
        tier.store(make_caches(spec, 4, seed=3), [(2, 1, key(2))])
        return tier.epoch


def loads_block(path: str, spec: KVCacheSpec = SPEC, identity: str = "") -> bool:
    with HostTier.open(path, spec, 8, identity=identity) as tier:
        return tier.load(zero_caches(spec, 4), [(1, 0, key(2))]) == []


def test_reopening_keeps_the_epoch_and_close_keeps_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    epoch = stored_one_block(path)
    assert os.path.exists(path)
    with HostTier.open(path, SPEC, 8) as tier:
        assert tier.epoch == epoch
    tier.close()  # a second close is harmless; using a closed tier is an error
    with pytest.raises(ValueError):
        tier.load(zero_caches(SPEC, 4), [(1, 0, key(2))])
    assert loads_block(path)


@pytest.mark.parametrize(
    "other",
    [
        {"spec": KVCacheSpec(3, 4, 2, 16, torch.float32)},
        {"spec": KVCacheSpec(3, 4, 2, 8, torch.bfloat16)},
        {"spec": KVCacheSpec(3, 8, 2, 4, torch.float32)},  # same bytes per block, other layout
        {"identity": "other-model"},
    ],
)
def test_another_layout_resets_the_file(tmp_path: Path, other: dict[str, object]) -> None:
    path = str(tmp_path / "tier")
    first = stored_one_block(path)
    spec = other.get("spec", SPEC)
    identity = other.get("identity", "")
    assert isinstance(spec, KVCacheSpec) and isinstance(identity, str)
    with HostTier.open(path, spec, 8, identity=identity) as tier:
        second = tier.epoch
    assert second != first
    assert not loads_block(path)  # reset again, to this layout: the block is gone


def test_another_size_resets_the_file(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    first = stored_one_block(path)
    with HostTier.open(path, SPEC, 9) as tier:
        assert tier.epoch != first


def damage_truncate(path: str) -> None:
    os.truncate(path, os.path.getsize(path) - 1)


def damage_magic(path: str) -> None:
    with open(path, "r+b") as handle:
        handle.write(b"X")


def damage_header_field(path: str) -> None:
    with open(path, "r+b") as handle:  # a byte of the epoch: only the header's CRC sees it
        handle.seek(17)
        byte = handle.read(1)
        handle.seek(17)
        handle.write(bytes([byte[0] ^ 1]))


@pytest.mark.parametrize("damage", [damage_truncate, damage_magic, damage_header_field])
def test_a_damaged_header_resets_the_file(tmp_path: Path, damage: Callable[[str], None]) -> None:
    path = str(tmp_path / "tier")
    first = stored_one_block(path)
    damage(path)
    with HostTier.open(path, SPEC, 8) as tier:
        assert tier.epoch != first
        assert tier.load(zero_caches(SPEC, 4), [(1, 0, key(2))]) == [0]


def patch_file(path: str, offset: int, data: bytes) -> None:
    """Writes through another file description, as another process would."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def tear_begun(tier: HostTier, slot: int) -> None:
    tier._begin_write(slot)  # killed before the first byte of data


def tear_half_copied(tier: HostTier, slot: int) -> None:
    tier._begin_write(slot)
    data = tier._layout.data_offset + slot * tier._layout.slot_stride
    patch_file(tier.path, data, b"\x7f" * (SPEC.bytes_per_block // 2))


def tear_sealed_but_generation_odd(tier: HostTier, slot: int) -> None:
    offset = FILE_HEADER_BYTES + slot * SLOT_HEADER_BYTES  # key and CRC in, generation not
    patch_file(tier.path, offset, (tier._generation(slot) + 1).to_bytes(8, "little"))


def tear_state_writing(tier: HostTier, slot: int) -> None:
    offset = FILE_HEADER_BYTES + slot * SLOT_HEADER_BYTES + 8
    patch_file(tier.path, offset, WRITING.to_bytes(4, "little"))


def tear_data_after_seal(tier: HostTier, slot: int) -> None:
    data = tier._layout.data_offset + slot * tier._layout.slot_stride
    patch_file(tier.path, data + SPEC.bytes_per_block - 3, b"\x01\x02\x03")


def tear_checksum(tier: HostTier, slot: int) -> None:
    offset = FILE_HEADER_BYTES + slot * SLOT_HEADER_BYTES + 12
    checksum = tier._map[offset : offset + 4]
    patch_file(tier.path, offset, bytes([checksum[0] ^ 0x80]) + checksum[1:])


@pytest.mark.parametrize(
    "tear",
    [
        tear_begun,
        tear_half_copied,
        tear_sealed_but_generation_odd,
        tear_state_writing,
        tear_data_after_seal,
        tear_checksum,
    ],
)
def test_a_torn_slot_is_refused_and_the_block_left_alone(
    tmp_path: Path, tear: Callable[[HostTier, int], None]
) -> None:
    source = make_caches(SPEC, 4, seed=4)
    target = make_caches(SPEC, 4, seed=5)
    before = [t.clone() for t in target]
    with HostTier.open(str(tmp_path / "tier"), SPEC, 8) as tier:
        tier.store(source, [(1, 6, key(1)), (2, 5, key(2))])
        tear(tier, 6)
        assert tier.load(target, [(6, 3, key(1)), (5, 0, key(2))]) == [3]
    assert same_block(target, 3, before, 3)
    assert same_block(target, 0, source, 2)


def test_a_wrong_key_is_refused(tmp_path: Path) -> None:
    with HostTier.open(str(tmp_path / "tier"), SPEC, 8) as tier:
        tier.store(make_caches(SPEC, 4, seed=3), [(2, 1, key(2))])
        assert tier.load(zero_caches(SPEC, 4), [(1, 0, key(3))]) == [0]
        assert tier.load(zero_caches(SPEC, 4), [(1, 0, key(2)[:31])]) == [0]
        assert tier.load(zero_caches(SPEC, 4), [(2, 0, key(2))]) == [0]  # never written


def test_invalidate_makes_loads_fail_until_stored_again(tmp_path: Path) -> None:
    source = make_caches(SPEC, 4, seed=3)
    with HostTier.open(str(tmp_path / "tier"), SPEC, 8) as tier:
        tier.store(source, [(2, 1, key(2)), (3, 4, key(3))])
        tier.invalidate([1])
        target = zero_caches(SPEC, 4)
        assert tier.load(target, [(1, 0, key(2)), (4, 1, key(3))]) == [0]
        tier.store(source, [(2, 1, key(2))])
        assert tier.load(target, [(1, 0, key(2))]) == []
    assert same_block(target, 0, source, 2)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with HostTier.open(str(tmp_path / "tier"), SPEC, 8) as tier:
        caches = zero_caches(SPEC, 4)
        with pytest.raises(ValueError):
            tier.store(caches, [(0, 8, key(0))])  # no slot 8
        with pytest.raises(ValueError):
            tier.store(caches, [(0, 1, key(0)), (2, 1, key(2))])  # slot 1 twice
        with pytest.raises(ValueError):
            tier.load(caches, [(0, 4, key(0))])  # no block 4
        with pytest.raises(ValueError):
            tier.load(caches, [(0, 1, key(0)), (2, 1, key(2))])  # block 1 twice
        with pytest.raises(ValueError):
            tier.store(caches[:2], [(0, 1, key(0))])  # a layer short
        with pytest.raises(ValueError):
            tier.store(zero_caches(KVCacheSpec(3, 4, 2, 8, torch.bfloat16), 4), [(0, 1, key(0))])


def test_a_file_open_elsewhere_is_not_reset(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    source = make_caches(SPEC, 4, seed=3)
    with HostTier.open(path, SPEC, 8) as tier:
        tier.store(source, [(2, 1, key(2))])
        with pytest.raises(HostTierBusy):
            HostTier.open(path, SPEC, 9)
        with HostTier.open(path, SPEC, 8) as second:  # the same layout may be shared
            assert second.epoch == tier.epoch
        assert tier.load(zero_caches(SPEC, 4), [(1, 0, key(2))]) == []


def test_sigkill_during_stores_leaves_no_wrong_data(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    child = run_child("store-forever", path)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    source = make_caches(KILL_SPEC, KILL_BLOCKS, seed=2)
    loaded = 0
    with HostTier.open(path, KILL_SPEC, KILL_SLOTS) as tier:
        for slot in range(KILL_SLOTS):
            for block in range(KILL_BLOCKS):
                target = make_caches(KILL_SPEC, 1, seed=6)
                before = [t.clone() for t in target]
                if tier.load(target, [(slot, 0, key(block))]) == []:
                    assert same_block(target, 0, source, block)
                    loaded += 1
                else:
                    assert same_block(target, 0, before, 0)
    assert KILL_SLOTS - 1 <= loaded <= KILL_SLOTS  # one key per slot; at most one torn slot


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this host")
def test_a_tier_in_dev_shm(tmp_path: Path) -> None:
    cluster = f"test-{uuid.uuid4().hex[:12]}"
    path = tier_path("/dev/shm", cluster, "g0", 1, 0)
    try:
        source = make_caches(SPEC, 4, seed=3)
        with HostTier.open(path, SPEC, 64) as tier:
            tier.store(source, [(3, 63, key(3))])
            target = zero_caches(SPEC, 4)
            assert tier.load(target, [(63, 2, key(3))]) == []
        assert same_block(target, 2, source, 3)
        assert os.stat(path).st_blocks * 512 < os.path.getsize(path)  # sparse
        assert remove_tier_files("/dev/shm", cluster) == [path]
        assert not os.path.exists(path)
    finally:
        remove_tier_files("/dev/shm", cluster)


def test_tier_paths_are_safe_and_removed_per_cluster(tmp_path: Path) -> None:
    directory = str(tmp_path)
    odd = tier_path(directory, "a/../b", "g 1", 0, 2)
    assert os.path.dirname(odd) == directory and " " not in odd and "/.." not in odd
    assert tier_path(directory, "a_b", "g", 0, 0) != tier_path(directory, "a/b", "g", 0, 0)
    mine = [tier_path(directory, "c1", "g", pp, tp) for pp in range(2) for tp in range(2)]
    theirs = tier_path(directory, "c10", "g", 0, 0)
    for path in [*mine, theirs, odd]:
        Path(path).touch()
    assert remove_tier_files(directory, "c1") == sorted(mine)
    assert sorted(os.listdir(directory)) == sorted([Path(theirs).name, Path(odd).name])
    assert remove_tier_files(str(tmp_path / "missing"), "c1") == []
