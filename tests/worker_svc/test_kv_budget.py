"""The KV cache sized from the device (worker_svc/kv_budget.py): the CPU budget from the
host's available memory (cgroup-aware), lazily zeroed CPU caches, the explicit overrides,
and the profiling pass the CUDA sizing runs, here on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_tiny_model
from worker_svc.kv_budget import GIB, available_cpu_memory, cpu_budget
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches
from worker_svc.kv_sizing import profile_forward
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _host(
    root: Path, available_kib: int, limit: str | None = None, usage: int | None = None
) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(
        f"MemTotal:       32000000 kB\nMemFree:         1000000 kB\n"
        f"MemAvailable:   {available_kib} kB\n"
    )
    if limit is not None:
        cgroup = root / "sys" / "fs" / "cgroup"
        cgroup.mkdir(parents=True)
        (cgroup / "memory.max").write_text(limit + "\n")
        (cgroup / "memory.current").write_text(f"{usage}\n")
    return root


def test_the_cpu_budget_is_a_fraction_of_what_is_available(tmp_path: Path) -> None:
    root = _host(tmp_path / "a", 10 * 1024 * 1024)  # 10 GiB available
    budget = cpu_budget(0.4, root)
    assert budget.bytes == int(0.4 * 10 * GIB)
    assert budget.sizing == "cpu: 0.4 of 10.00 GiB available (MemAvailable) = 4.00 GiB"
    # A container's limit counts when it leaves less than the host's MemAvailable.
    limited = _host(tmp_path / "b", 10 * 1024 * 1024, limit=str(3 * GIB), usage=GIB)
    assert available_cpu_memory(limited) == (2 * GIB, "the cgroup's memory.max - memory.current")
    unlimited = _host(tmp_path / "c", 10 * 1024 * 1024, limit="max", usage=GIB)
    assert available_cpu_memory(unlimited)[0] == 10 * GIB
    with pytest.raises(ValueError, match="cpu_kv_cache_fraction"):
        cpu_budget(0.0, root)


def test_cpu_caches_are_zero_and_cost_no_memory_until_written() -> None:
    def rss_kib() -> int:
        line = next(
            l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")
        )
        return int(line.split()[1])

    before = rss_kib()
    caches = allocate_kv_caches(KVCacheSpec(4, 16, 2, 64, torch.float32), 16384, "cpu")
    assert rss_kib() - before < 64 * 1024  # 4 x 512 MiB allocated, almost nothing resident
    assert all(c.shape == (2, 16384, 16, 2, 64) and c.is_contiguous() for c in caches)
    assert not caches[3][:, -8:].any()  # zeros wherever read
    caches[3][1, -1] = 7.0
    assert float(caches[3].sum()) == 7.0 * 16 * 2 * 64


def test_a_runner_without_a_budget_sizes_its_cache_from_the_host(tiny_llama: Path) -> None:
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(tiny_llama), cpu_kv_cache_fraction=0.01)
    )
    info = runner.info()
    expected = int(0.01 * available_cpu_memory()[0]) // runner.kv_spec.bytes_per_block
    assert abs(info.num_blocks - expected) <= 0.05 * expected  # free memory moves a little
    assert info.kv_cache_sizing.startswith("cpu: 0.01 of ")
    assert info.kv_cache_bytes == info.num_blocks * runner.kv_spec.bytes_per_block
    given = ModelRunner.from_config(
        RunnerConfig(model_path=str(tiny_llama), kv_cache_memory_bytes=GIB // 64)
    ).info()
    assert given.kv_cache_sizing == "--kv-cache-memory-gib 0.02 GiB, as given"
    assert given.num_blocks == (GIB // 64) // runner.kv_spec.bytes_per_block
    counted = ModelRunner.from_config(RunnerConfig(model_path=str(tiny_llama), num_blocks=7))
    assert counted.info().kv_cache_sizing == "--num-kv-blocks 7, as given"


def test_the_profiling_pass_runs_a_whole_step_of_tokens(tiny_llama: Path) -> None:
    # The pass CUDA sizing measures; on CPU it must run (any shape bug would show here).
    runner = ModelRunner.from_config(RunnerConfig(model_path=str(tiny_llama), num_blocks=4))
    config = RunnerConfig(model_path=str(tiny_llama), max_num_batched_tokens=100, max_num_seqs=7)
    calls = []
    original = runner.model.compute_logits
    runner.model.compute_logits = lambda h, r: calls.append(h.shape) or original(h, r)
    profile_forward(runner.model, runner.metadata, runner.kv_spec, config)
    assert calls == [torch.Size([7, runner.model.config.hidden_size])]
