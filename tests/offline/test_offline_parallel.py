"""`pagemesh.LLM` with tensor or pipeline parallelism: local worker processes (gloo on CPU)
give the one-rank engine's greedy tokens, a dead rank fails a call instead of hanging it,
and nothing outlives `close()`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pagemesh import LLM, SamplingParams
from pagemesh.tools.testing.tiny_models import write_realistic_model

ENGINE_ARGS = {"dtype": "float32", "kv_cache_memory_gib": 0.02, "swap_space": 0}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox", "Paris is the capital of", [5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_realistic_model(
        tmp_path_factory.mktemp("offline-tp") / "tiny-llama", "llama", seed=4
    )


@pytest.fixture(scope="module")
def one_rank_tokens(model_dir: Path) -> list[list[int]]:
    with LLM(str(model_dir), **ENGINE_ARGS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone too (its parent has not reaped it yet).
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_parallel_greedy_equals_one_rank_and_close_stops_the_ranks(
    model_dir: Path, one_rank_tokens: list[list[int]], tp: int, pp: int
) -> None:
    llm = LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE_ARGS)
    pids = [p.pid for p in llm._workers.processes]
    assert len(pids) == 2 and all(_alive(pid) for pid in pids)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == one_rank_tokens
    seeded = SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True)
    assert len(llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs) == 2
    # A rank that dies fails the next call at once (its peer's connection breaks), no hang.
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="generation failed"):
        llm.generate("x", use_tqdm=False)
    llm.close()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("x", use_tqdm=False)


def test_ranks_stop_at_interpreter_exit(model_dir: Path) -> None:
    """A script that never calls close() (and has no __main__ guard) leaves nothing behind."""
    script = (
        "from pagemesh import LLM, SamplingParams\n"
        f"llm = LLM({str(model_dir)!r}, tensor_parallel_size=2, dtype='float32', "
        "kv_cache_memory_gib=0.02, swap_space=0)\n"
        "print(*[p.pid for p in llm._workers.processes])\n"
        "print(llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False)[0]\n"
        "      .outputs[0].token_ids)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(pid) for pid in done.stdout.splitlines()[0].split()]
    leftovers = [pid for pid in pids if _alive(pid)]
    for pid in leftovers:  # ours: do not leave them to the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not leftovers
