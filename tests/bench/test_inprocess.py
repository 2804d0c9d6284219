"""The in-process engine core of `bench/inprocess.py` and the figures `bench/compare.py`
derives: they feed the benchmarks' comparison (docs/benchmarks.md), so they are checked on a
tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.compare import matmul_flop_per_token
from bench.inprocess import build_engine, run_requests
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.hf_reference import assert_greedy_match, hf_greedy


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("inprocess") / "llama", "llama", seed=3)


def test_in_process_core_generates_what_transformers_does(tiny: Path) -> None:
    scheduler, runner = build_engine(str(tiny), max_num_batched_tokens=512)
    prompts = [[5, 9, 11, 200, 7], [3] * 17, list(range(40, 90))]
    result = run_requests(scheduler, runner, prompts, max_tokens=6, workload="tiny")
    assert (result.num_requests, result.output_tokens, result.num_errors) == (3, 18, 0)
    assert len(result.ttft_ms) == 3 and len(result.itl_ms) == 3 * 5 and len(result.e2e_ms) == 3
    assert result.output_tok_s > 0 and result.dtype == "float32"
    # The tokens themselves: the same core the mesh runs, checked against transformers.
    assert not scheduler.requests  # all finished and forgotten
    hf = AutoModelForCausalLM.from_pretrained(tiny, torch_dtype=torch.float32)
    scheduler, runner = build_engine(str(tiny))
    ours = _tokens(scheduler, runner, prompts[2], 6)
    assert_greedy_match(hf, prompts[2], ours, hf_greedy(hf, prompts[2], 6))


def _tokens(scheduler, runner, prompt: list[int], max_tokens: int) -> list[int]:
    from scheduler_svc import convert as scheduler_convert
    from scheduler_svc.core.types import Request, RequestId, SamplingParams
    from worker_svc import convert as worker_convert

    request = Request(
        RequestId("one"), list(prompt), SamplingParams(temperature=0.0), max_tokens=max_tokens
    )
    scheduler.add_request(request)
    while scheduler.has_work():
        output = scheduler.schedule()
        step = worker_convert.scheduler_output_from_pb(
            scheduler_convert.scheduler_output_to_pb(output)
        )
        response = worker_convert.model_runner_output_to_pb(runner.execute_step(step))
        scheduler.update(output, scheduler_convert.model_runner_output_from_pb(response))
    return request.output_token_ids


def test_matmul_flop_per_token_counts_every_linear_layer(tmp_path: Path) -> None:
    config = {
        "hidden_size": 512,
        "intermediate_size": 1408,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_hidden_layers": 8,
        "vocab_size": 32000,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_layer = 512 * (8 + 2 * 4) * 64 + 512 * 512 + 3 * 512 * 1408
    assert matmul_flop_per_token(str(tmp_path)) == 2 * (8 * per_layer + 512 * 32000)
    assert round(matmul_flop_per_token(str(tmp_path)) / 1e6, 1) == 80.0  # W64: 80 MFLOP
