"""Swap-out / swap-in and copy-on-write block moves keep a request's KV intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

BLOCK_SIZE = 4
PROMPT = [5, 17, 33, 2, 90, 41, 7, 61, 12, 3]  # 10 tokens: two full blocks and a partial one
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("moves") / "llama", "llama", seed=3)


def make_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner.from_config(
        RunnerConfig(
            model_path=str(model_dir),
            block_size=BLOCK_SIZE,
            num_blocks=16,
            swap_space_bytes=1 << 20,
        )
    )


def decode(
    runner: ModelRunner,
    request_id: str,
    step_id: int,
    num_computed: int,
    num_steps: int,
    new_blocks: list[list[int]],
    last_token: int,
) -> list[int]:
    """`num_steps` decode steps; each tells the runner the token sampled by the previous one."""
    tokens = [last_token]
    for i in range(num_steps):
        cached = CachedRequestData(request_id, new_blocks[i], num_computed + i, [tokens[-1]])
        out = runner.execute_step(
            SchedulerOutput(
                step_id + i, cached_requests=[cached], num_scheduled_tokens={request_id: 1}
            )
        )
        tokens.append(out.sampled[request_id].token_id)
    return tokens[1:]


def prefill(runner: ModelRunner, request_id: str, blocks: list[int]) -> int:
    out = runner.execute_step(
        SchedulerOutput(
            0,
            new_requests=[NewRequestData(request_id, list(PROMPT), len(PROMPT), blocks, 0, GREEDY)],
            num_scheduled_tokens={request_id: len(PROMPT)},
        )
    )
    return out.sampled[request_id].token_id


def test_swap_out_and_back_in_elsewhere_gives_the_same_tokens(model_dir: Path) -> None:
    reference = make_runner(model_dir)
    first = prefill(reference, "r", [0, 1, 2])
    expected = decode(reference, "r", 1, len(PROMPT), 3, [[], [3], []], first)

    runner = make_runner(model_dir)
    assert runner.num_swap_blocks > 3
    assert prefill(runner, "r", [0, 1, 2]) == first
    # Preempt by swapping: copy to swap blocks 7, 8, 9 and forget the request ...
    runner.execute_step(
        SchedulerOutput(1, finished_request_ids=["r"], blocks_to_swap_out=[(0, 7), (1, 8), (2, 9)])
    )
    for cache in runner.kv_caches:  # ... and let other requests overwrite its device blocks
        cache[:, :3] = torch.randn_like(cache[:, :3])
    # Resume in other device blocks, sent in full with its computed tokens kept.
    tokens = [*PROMPT, first]
    out = runner.execute_step(
        SchedulerOutput(
            2,
            new_requests=[
                NewRequestData("r", tokens, len(PROMPT), [10, 11, 12], len(PROMPT), GREEDY)
            ],
            num_scheduled_tokens={"r": 1},
            blocks_to_swap_in=[(7, 10), (8, 11), (9, 12)],
        )
    )
    second = out.sampled["r"].token_id
    resumed = [second, *decode(runner, "r", 3, len(PROMPT) + 1, 2, [[13], []], second)]
    assert resumed == expected


def test_copy_on_write_fork_continues_from_the_shared_prompt(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    first = prefill(runner, "leader", [0, 1, 2])
    # The fork shares blocks 0 and 1, copies the partly filled block 2 into 5, and
    # recomputes the last prompt token to get logits of its own.
    out = runner.execute_step(
        SchedulerOutput(
            1,
            new_requests=[
                NewRequestData(
                    "fork", list(PROMPT), len(PROMPT), [0, 1, 5], len(PROMPT) - 1, GREEDY
                )
            ],
            num_scheduled_tokens={"fork": 1},
            blocks_to_copy=[(2, 5)],
        )
    )
    assert out.sampled["fork"].token_id == first  # greedy: the same first token


def test_moves_outside_the_cache_are_rejected(model_dir: Path) -> None:
    runner = make_runner(model_dir)
    with pytest.raises(ValueError, match="outside the cache"):
        runner.execute_step(SchedulerOutput(0, blocks_to_copy=[(0, 99)]))
    with pytest.raises(ValueError, match="outside the cache"):
        runner.execute_step(SchedulerOutput(0, blocks_to_swap_out=[(0, runner.num_swap_blocks)]))
