"""One rank's diagnostics, with no gRPC: its memory, its step statistics, a profiler trace.

The worker's servicer (worker_svc/servicer.py) serves them as the Worker's admin RPCs; the
in-process engine can call the same functions on its own `ModelRunner`.

- `memory_stats(runner)`: weights, KV cache and swap space as allocated, process RSS and, on
  CUDA, what torch holds on the device. Which KV blocks are in use is the scheduler's fact,
  not the worker's: it is added there.
- `StepStats`: cumulative and windowed step figures. `run_step_recorded(runner, step,
  stats)` runs one step and records it; it must run on the thread that runs the steps.
- `Profiler`: a torch.profiler trace between `start` and `stop`, written as one Chrome trace
  file. Start and stop it on the model thread, where the steps run.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from protos.step import ModelRunnerOutput, SchedulerOutput
from worker_svc.model.matmul import packed_weight_bytes

if TYPE_CHECKING:
    from worker_svc.runner import ModelRunner

DEFAULT_WINDOW_S = 60.0
MAX_WINDOW_S = 3600.0


# --- memory ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory, in bytes unless named in blocks."""

    device: str  # "cpu", "cuda:0", ...
    weight_bytes: int  # model weights as held (quantized or packed)
    num_allocated_kv_blocks: int  # KV blocks this rank allocated
    kv_bytes_per_block: int  # one block, all of this rank's layers and KV heads
    kv_cache_bytes: int  # num_allocated_kv_blocks x kv_bytes_per_block
    num_swap_blocks: int  # CPU swap space, in blocks
    swap_bytes: int
    rss_bytes: int  # resident set size of this process
    device_allocated_bytes: int = 0  # CUDA only: torch's allocated, reserved and the total
    device_reserved_bytes: int = 0
    device_total_bytes: int = 0


def memory_stats(runner: ModelRunner) -> RankMemory:
    """The rank's memory now. Cheap enough to call on a request (no allocation, no sync)."""
    bytes_per_block = runner.kv_spec.bytes_per_block
    device = runner.device
    allocated = reserved = total = 0
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    return RankMemory(
        device=str(device),
        weight_bytes=packed_weight_bytes(runner.model),
        num_allocated_kv_blocks=runner.num_blocks,
        kv_bytes_per_block=bytes_per_block,
        kv_cache_bytes=runner.num_blocks * bytes_per_block,
        num_swap_blocks=runner.num_swap_blocks,
        swap_bytes=runner.num_swap_blocks * bytes_per_block,
        rss_bytes=process_rss_bytes(),
        device_allocated_bytes=allocated,
        device_reserved_bytes=reserved,
        device_total_bytes=total,
    )


def process_rss_bytes() -> int:
    """This process's resident set size (Linux /proc; elsewhere its peak, via resource)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # peak, in KiB on Linux and bytes on macOS: a fallback only

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- step statistics ---------------------------------------------------------------------


@dataclass(frozen=True)
class StepStatsSnapshot:
    """Step figures of one rank, in seconds and steps.

    Cumulative since the accumulator was made (`num_steps`, `busy_s`, ...), and over the
    last `window_s` seconds (`window_*`). `busy_s` is wall time in steps; `collective_s`
    (tensor-parallel collectives), `pp_send_s` and `pp_recv_s` (pipeline transfers, a
    receive including the wait for the previous stage) are parts of it.
    """

    num_steps: int
    busy_s: float
    collective_s: float
    pp_send_s: float
    pp_recv_s: float
    window_s: float
    window_num_steps: int
    window_busy_s: float
    window_communication_s: float

    @property
    def utilization(self) -> float:
        """Fraction of the window spent in steps, 0..1."""
        return min(1.0, self.window_busy_s / self.window_s) if self.window_s > 0 else 0.0

    @property
    def compute_fraction(self) -> float:
        """Fraction of the window's step time not spent communicating, 0..1."""
        if self.window_busy_s <= 0:
            return 0.0
        return max(0.0, 1.0 - self.window_communication_s / self.window_busy_s)


class StepStats:
    """Accumulates steps as they end (`record`, from the model thread) and answers
    snapshots (`snapshot`, from any thread).

    The window figures come from one bucket per second of the last `MAX_WINDOW_S`, so the
    memory is bounded whatever the step rate; a window's edges are exact to a second.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.started_s = clock()
        self.num_steps = 0
        self.busy_s = 0.0
        self.collective_s = 0.0
        self.pp_send_s = 0.0
        self.pp_recv_s = 0.0
        # [second, steps, busy seconds, communication seconds], oldest first.
        self._buckets: deque[list[float]] = deque()

    def record(
        self,
        busy_s: float,
        collective_s: float = 0.0,
        pp_send_s: float = 0.0,
        pp_recv_s: float = 0.0,
    ) -> None:
        """One step that ended now: its wall time and, of it, communication seconds."""
        now = self._clock()
        second = float(int(now))
        communication_s = collective_s + pp_send_s + pp_recv_s
        with self._lock:
            self.num_steps += 1
            self.busy_s += busy_s
            self.collective_s += collective_s
            self.pp_send_s += pp_send_s
            self.pp_recv_s += pp_recv_s
            buckets = self._buckets
            if buckets and buckets[-1][0] == second:
                bucket = buckets[-1]
                bucket[1] += 1
                bucket[2] += busy_s
                bucket[3] += communication_s
            else:
                buckets.append([second, 1, busy_s, communication_s])
            while buckets and buckets[0][0] < now - MAX_WINDOW_S - 1:
                buckets.popleft()

    def snapshot(self, window_s: float = DEFAULT_WINDOW_S) -> StepStatsSnapshot:
        """The figures now, the window ones over the last `window_s` seconds (at most
        `MAX_WINDOW_S`; shorter when the accumulator is younger)."""
        if window_s <= 0:
            window_s = DEFAULT_WINDOW_S
        window_s = min(window_s, MAX_WINDOW_S)
        now = self._clock()
        window_s = min(window_s, now - self.started_s)
        since = now - window_s
        steps, busy_s, communication_s = 0, 0.0, 0.0
        with self._lock:
            for second, num, busy, comm in reversed(self._buckets):
                if second + 1 <= since:
                    break
                steps += int(num)
                busy_s += busy
                communication_s += comm
            return StepStatsSnapshot(
                num_steps=self.num_steps,
                busy_s=self.busy_s,
                collective_s=self.collective_s,
                pp_send_s=self.pp_send_s,
                pp_recv_s=self.pp_recv_s,
                window_s=window_s,
                window_num_steps=steps,
                window_busy_s=min(busy_s, window_s),
                window_communication_s=min(communication_s, window_s),
            )


def run_step_recorded(
    runner: ModelRunner, step: SchedulerOutput, stats: StepStats
) -> ModelRunnerOutput:
    """`runner.execute_step(step)`, recorded in `stats` when it succeeds: its wall time and
    the communication its process group timed meanwhile. Call it on the model thread."""
    dist = runner.dist
    before = (dist.tp_collective_time_s, dist.pp_send_time_s, dist.pp_recv_time_s)
    started = time.perf_counter()
    output = runner.execute_step(step)
    stats.record(
        time.perf_counter() - started,
        collective_s=dist.tp_collective_time_s - before[0],
        pp_send_s=dist.pp_send_time_s - before[1],
        pp_recv_s=dist.pp_recv_time_s - before[2],
    )
    return output


# --- profiler ----------------------------------------------------------------------------


class ProfilerStateError(Exception):
    """A trace was started while one runs, or stopped while none does."""


@dataclass(frozen=True)
class ProfileTraceFile:
    """A trace written by `Profiler.stop`."""

    host: str  # hostname of the machine the file is on
    path: str  # absolute path of the Chrome trace JSON there
    duration_s: float  # seconds between start and stop
    num_steps: int  # steps recorded meanwhile


class ProfilerPathError(ValueError):
    """A trace folder outside the worker's --profile-dir."""


def default_profile_dir() -> Path:
    return Path(tempfile.gettempdir()) / "pagemesh-profiles"


class Profiler:
    """One torch.profiler trace at a time: CPU activity, and CUDA on a CUDA device.

    A worker's traces are written only under `base_dir` (--profile-dir): a caller names a
    folder in it and cannot make the worker create folders or files anywhere else. `start` and
    `stop`
    must run on the thread that runs the steps (the profiler records the ops of the thread
    that started it)."""

    def __init__(
        self,
        device: torch.device | str,
        stats: StepStats | None = None,
        base_dir: Path | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.stats = stats
        # None: anywhere (the offline engine: its caller owns the process already).
        self.base_dir = base_dir.expanduser().resolve() if base_dir is not None else None
        self.num_started = 0  # which trace runs: an automatic stop stops only its own
        self._profile: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._started_s = 0.0
        self._steps_at_start = 0

    @property
    def running(self) -> bool:
        return self._profile is not None

    def folder(self, out_dir: str) -> Path:
        """Where `out_dir` (relative to the base folder, or absolute inside it) resolves;
        ProfilerPathError outside it (`..`, another absolute path, a symbolic link out)."""
        if self.base_dir is None:
            return Path(out_dir or ".").expanduser().resolve()
        folder = (self.base_dir / (out_dir or ".")).resolve()
        if not folder.is_relative_to(self.base_dir):
            raise ProfilerPathError(
                f"traces are written only under this worker's --profile-dir {self.base_dir}; "
                f"{out_dir!r} is outside it: name a folder inside it (relative paths are "
                "taken from it)"
            )
        return folder

    def start(
        self, out_dir: str, trace_name: str, record_shapes: bool = False, with_stack: bool = False
    ) -> int:
        """Starts tracing; the file will be `<out_dir>/<trace_name>.json` under the base
        folder (created now, so a folder that cannot be written fails here, not at `stop`).
        Returns the trace's number (`stop(only=...)`). Raises ProfilerStateError when a
        trace runs, ProfilerPathError outside the base folder, OSError for an unusable one."""
        if self._profile is not None:
            raise ProfilerStateError(f"a profiler trace is already running (to {self._path})")
        folder = self.folder(out_dir)
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"cannot write to {folder}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities, record_shapes=record_shapes, with_stack=with_stack
        )
        profile.start()
        self._profile, self._path = profile, folder / f"{trace_name}.json"
        self._started_s = time.monotonic()
        self._steps_at_start = self.stats.num_steps if self.stats is not None else 0
        self.num_started += 1
        return self.num_started

    def stop(self, only: int | None = None) -> ProfileTraceFile:
        """Stops tracing and writes the trace. Raises ProfilerStateError when none runs
        (or, with `only`, when the one running is not trace number `only`)."""
        profile, path = self._profile, self._path
        if profile is None or path is None or (only is not None and only != self.num_started):
            raise ProfilerStateError("no profiler trace is running")
        self._profile = self._path = None
        profile.stop()
        profile.export_chrome_trace(str(path))
        num_steps = (self.stats.num_steps - self._steps_at_start) if self.stats is not None else 0
        return ProfileTraceFile(
            host=socket.gethostname(),
            path=str(path),
            duration_s=time.monotonic() - self._started_s,
            num_steps=num_steps,
        )
