"""`pagemesh.LLM`'s admin and diagnostics calls, as the mesh's Admin service answers them:
memory per rank with the scheduler's KV blocks, step statistics recorded on every rank,
and a torch.profiler trace per rank, started and stopped where the steps run."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagemesh import LLM, SamplingParams
from pagemesh.tools.testing.tiny_models import write_tiny_model
from worker_svc.diagnostics import ProfilerStateError

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_gib": 0.02, "swap_space": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paris is the capital of"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("offline-admin") / "tiny-llama", "llama", seed=5
    )


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(str(model_dir), **ENGINE_ARGS) as engine:
        yield engine


def _assert_memory_adds_up(llm: LLM, num_ranks: int) -> None:
    ranks = llm.get_memory()
    assert [(m.rank, m.tp_rank, m.pp_rank) for m in ranks] == [
        (r, r % num_ranks, 0) for r in range(num_ranks)
    ]
    for m in ranks:
        assert m.num_kv_blocks == llm.num_kv_blocks
        assert m.num_used_kv_blocks + m.num_free_kv_blocks == m.num_kv_blocks
        assert m.kv_cache_used_bytes == m.num_used_kv_blocks * m.memory.kv_bytes_per_block
        assert m.memory.weight_bytes > 0 and m.memory.rss_bytes > 0
        assert m.memory.num_allocated_kv_blocks >= m.num_kv_blocks
        assert m.memory.kv_cache_bytes == (
            m.memory.num_allocated_kv_blocks * m.memory.kv_bytes_per_block
        )
        assert m.memory.device == "cpu" and m.num_used_swap_blocks == 0


def _assert_traces(paths: list[str], out_dir: Path, num_ranks: int) -> None:
    assert len(paths) == num_ranks and len(set(paths)) == num_ranks
    for path in paths:
        assert Path(path).parent == out_dir.resolve()
        trace = json.loads(Path(path).read_text())
        assert trace["traceEvents"], path


def test_memory_adds_up_and_blocks_are_the_schedulers(llm: LLM) -> None:
    _assert_memory_adds_up(llm, 1)
    assert llm.get_memory()[0].num_used_kv_blocks == 0  # nothing runs between calls
    table = io.StringIO()
    llm.print_memory_stats(table)
    lines = table.getvalue().splitlines()
    assert len(lines) == 2 and "RSS" in lines[0] and lines[1].split()[3] == "cpu"


def test_step_stats_grow_with_a_generate(llm: LLM) -> None:
    before = llm.get_step_stats()[0].stats
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    [after] = llm.get_step_stats(window_s=60.0)
    assert (after.rank, after.tp_rank, after.pp_rank) == (0, 0, 0)
    stats = after.stats
    assert stats.num_steps >= before.num_steps + GREEDY.max_tokens
    assert stats.busy_s > before.busy_s
    assert stats.window_num_steps >= GREEDY.max_tokens and stats.window_busy_s > 0
    assert 0 < stats.utilization <= 1
    assert stats.collective_s == 0  # one rank: nothing to reduce
    with pytest.raises(ValueError, match="window_s"):
        llm.get_step_stats(window_s=0)


def test_profile_writes_a_chrome_trace_with_events(llm: LLM, tmp_path: Path) -> None:
    with pytest.raises(ProfilerStateError):
        llm.stop_profile()
    llm.start_profile(str(tmp_path / "traces"))
    with pytest.raises(ProfilerStateError):
        llm.start_profile(str(tmp_path / "traces"))
    llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    paths = llm.stop_profile()
    _assert_traces(paths, tmp_path / "traces", 1)
    # The steps' ops were recorded: the trace was started on the thread that ran them.
    events = json.loads(Path(paths[0]).read_text())["traceEvents"]
    assert any("aten::" in str(event.get("name", "")) for event in events)


def test_two_ranks_report_and_trace_each(model_dir: Path, tmp_path: Path) -> None:
    with LLM(str(model_dir), tensor_parallel_size=2, **ENGINE_ARGS) as llm:
        _assert_memory_adds_up(llm, 2)
        llm.start_profile(str(tmp_path))
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        paths = llm.stop_profile()
        _assert_traces(paths, tmp_path, 2)
        ranks = llm.get_step_stats()
        assert [r.tp_rank for r in ranks] == [0, 1]
        for r in ranks:
            assert r.stats.num_steps >= GREEDY.max_tokens and r.stats.busy_s > 0
            assert 0 < r.stats.collective_s <= r.stats.busy_s  # all-reduces, timed by gloo
        # A refusal on the ranks reaches the caller, and the ranks still serve steps.
        with pytest.raises(ProfilerStateError):
            llm.stop_profile()
        assert len(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
