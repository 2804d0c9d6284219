"""The idle-time fault-in of a CPU KV cache's pages (`worker_svc/kv_prefault.py`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import time
from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches
from worker_svc.kv_prefault import KVPrefault
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

SPEC = KVCacheSpec(
    num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32
)  # 8 KiB blocks: two pages each


def resident_pages(tensor: torch.Tensor, first_byte: int, num_bytes: int) -> int:
    """How many pages of `tensor`'s bytes [first_byte, first_byte + num_bytes) are in
    memory (mincore)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = tensor.data_ptr() + first_byte
    assert start % page == 0 and num_bytes % page == 0
    flags = (ctypes.c_ubyte * (num_bytes // page))()
    assert libc.mincore(start, num_bytes, flags) == 0, ctypes.get_errno()
    return sum(flag & 1 for flag in flags)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def populate_works() -> bool:
    probe = allocate_kv_caches(SPEC, 4, "cpu")
    prefault = KVPrefault(probe, 4, ahead_blocks=4, idle_s=0.0)
    return prefault._madvise is not None and prefault._populate(0, 1)


needs_populate = pytest.mark.skipif(
    not populate_works(), reason="no madvise(MADV_POPULATE_WRITE): Linux < 5.14"
)


@needs_populate
def test_pages_ahead_of_the_used_blocks_are_faulted_in_and_left_as_they_were():
    num_blocks = 256
    caches = allocate_kv_caches(SPEC, num_blocks, "cpu")
    block_bytes = SPEC.block_size * SPEC.num_kv_heads * SPEC.head_dim * 4
    caches[1][0, 3] = 5.0  # a block a step already wrote (K of block 3, layer 1)
    caches[2][1, 40] = -2.0  # and one past the window (V of block 40, layer 2)
    assert resident_pages(caches[0], 0, 64 * block_bytes) == 0
    prefault = KVPrefault(caches, num_blocks, ahead_blocks=32, idle_s=0.0).start()
    try:
        prefault.used_up_to(7)  # blocks 0-7 in use: 0-39 should be faulted in
        wait_for(lambda: prefault.next_block >= 40)
        time.sleep(0.05)
        assert prefault.next_block == 40
        pages_per_block = block_bytes // mmap.PAGESIZE
        for cache in caches:  # K and V of blocks 0-39 in, 48 and on not
            assert resident_pages(cache, 0, 40 * block_bytes) == 40 * pages_per_block
            assert (
                resident_pages(cache, num_blocks * block_bytes, 40 * block_bytes)
                == 40 * pages_per_block
            )
            assert resident_pages(cache, 48 * block_bytes, 64 * block_bytes) == 0
        assert prefault.faulted_bytes == 2 * len(caches) * 40 * block_bytes
        # Contents untouched: the written blocks keep their values, the rest reads zero.
        assert bool((caches[1][0, 3] == 5.0).all()) and bool((caches[2][1, 40] == -2.0).all())
        assert float(caches[0].abs().sum()) == 0.0
        prefault.used_up_to(250)  # the window reaches the cache's end, not past it
        wait_for(lambda: prefault.next_block == num_blocks)
    finally:
        prefault.stop()


@needs_populate
def test_no_page_is_faulted_in_while_a_step_runs_or_before_the_worker_idles():
    caches = allocate_kv_caches(SPEC, 64, "cpu")
    prefault = KVPrefault(caches, 64, ahead_blocks=64, idle_s=0.2)
    prefault.step_started()
    prefault.start()
    try:
        time.sleep(0.4)
        assert prefault.next_block == 0  # busy
        prefault.step_done()
        time.sleep(0.1)
        assert prefault.next_block == 0  # idle, but not for idle_s yet
        wait_for(lambda: prefault.next_block == 64)
    finally:
        prefault.stop()


def test_a_cpu_runner_faults_in_ahead_of_its_steps(tmp_path: Path):
    model = write_tiny_model(tmp_path / "llama", "llama")
    runner = ModelRunner.from_config(
        RunnerConfig(
            model_path=str(model), num_blocks=512, max_num_batched_tokens=64, kv_prefault_steps=2
        )
    )
    prefault = runner.kv_prefault
    assert prefault is not None and prefault.ahead_blocks == 2 * 64 // 16
    request = NewRequestData(
        "a", list(range(1, 40)), 39, [20, 21, 22], 0, SamplingParams(temperature=0.0)
    )
    runner.execute_step(
        SchedulerOutput(step_id=1, new_requests=[request], num_scheduled_tokens={"a": 39})
    )
    assert prefault.high_water == 22 and prefault.target() == 31
    if populate_works():
        wait_for(lambda: prefault.next_block == 31)
    off = ModelRunner.from_config(
        RunnerConfig(model_path=str(model), num_blocks=64, kv_prefault_steps=0)
    )
    assert off.kv_prefault is None
