"""The runner, driven step by step like the scheduler would, against transformers.

Greedy tokens must equal `generate(do_sample=False)` token for token; a divergence is
accepted only at a demonstrated near-tie (HF's top-2 logits within 1e-4 there).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from pagemesh.tools.testing.tiny_models import write_realistic_model, write_tiny_model
from protos.step import (
    CachedRequestData,
    NewRequestData,
    SampledToken,
    SamplingParams,
    SchedulerOutput,
)
from tests.support.hf_reference import (
    assert_greedy_close,
    assert_half_precision_close,
    assert_logprobs_close,
    half_precision_references,
    hf_greedy_with_logits,
)
from tests.support.runner_script import (
    BLOCK_SIZE,
    GREEDY,
    NUM_NEW_TOKENS,
    ScriptedRequest,
    drive,
    random_prompt,
)
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama3_rope": dict(arch="llama", llama3_rope=True),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "mistral": dict(arch="mistral"),
    "mistral_sliding_window": dict(arch="mistral", sliding_window=6),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_model(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def make_runner(path: Path, num_blocks: int = 48) -> ModelRunner:
    return ModelRunner.from_config(
        RunnerConfig(model_path=str(path), block_size=BLOCK_SIZE, num_blocks=num_blocks)
    )


def test_continuous_batching_matches_hf_generate(tiny_model: Path) -> None:
    from transformers import AutoModelForCausalLM

    runner = make_runner(tiny_model)
    vocab_size = runner.info().vocab_size
    requests = [
        ScriptedRequest("a", random_prompt(9, vocab_size, 1), join_step=0),
        ScriptedRequest("b", random_prompt(21, vocab_size, 2), join_step=0, prefill_chunk=8),
        ScriptedRequest("c", random_prompt(5, vocab_size, 3), join_step=2),
        ScriptedRequest("d", random_prompt(16, vocab_size, 4), join_step=4, prefill_chunk=7),
        ScriptedRequest("e", random_prompt(1, vocab_size, 5), join_step=13),
    ]
    drive(runner, requests, NUM_NEW_TOKENS)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation="eager")
    for r in requests:
        hf_tokens, hf_logits = hf_greedy_with_logits(hf_model, r.prompt, NUM_NEW_TOKENS)
        assert_greedy_close(r.outputs, hf_tokens, hf_logits)
    assert runner.requests.keys() == {"e"}  # the others were dropped via finished ids


def test_rebuilt_request_continues_where_it_left_off(tiny_model: Path) -> None:
    """A preempted request comes back as a new request carrying its outputs so far."""
    runner = make_runner(tiny_model)
    prompt = random_prompt(7, runner.info().vocab_size, 6)
    first = ScriptedRequest("r", prompt, join_step=0)
    drive(runner, [first], NUM_NEW_TOKENS)
    runner.execute_step(SchedulerOutput(100, finished_request_ids=["r"]))
    assert not runner.requests

    resumed = ScriptedRequest(
        "r", prompt, join_step=0, prefill_chunk=5, outputs=list(first.outputs[:5])
    )
    drive(runner, [resumed], NUM_NEW_TOKENS)
    assert resumed.outputs == first.outputs
    assert runner.requests["r"].num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("tiny_model", ["llama", "qwen3"], indirect=True)
def test_a_seed_gives_the_same_tokens_alone_batched_and_resumed(tiny_model: Path) -> None:
    """Seeded sampling (with every filter) is a function of seed and position only: the same
    tokens alone, in a batch with other requests joining at other steps, and when the request
    is rebuilt half-way with its outputs so far (what a resume on another group does)."""
    seeded = SamplingParams(
        temperature=1.3,
        top_k=50,
        top_p=0.9,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        seed=2024,
    )
    runner = make_runner(tiny_model)
    vocab_size = runner.info().vocab_size
    prompt = random_prompt(9, vocab_size, 31)
    alone = ScriptedRequest("s", prompt, join_step=0)
    drive(runner, [alone], NUM_NEW_TOKENS, seeded)
    runner.execute_step(SchedulerOutput(100, finished_request_ids=["s"]))

    batched = [
        ScriptedRequest("s", prompt, join_step=1, prefill_chunk=4),
        *(
            ScriptedRequest(f"other{i}", random_prompt(5 + 3 * i, vocab_size, 40 + i), join_step=i)
            for i in range(3)
        ),
    ]
    drive(make_runner(tiny_model), batched, NUM_NEW_TOKENS, seeded)
    assert batched[0].outputs == alone.outputs

    resumed = ScriptedRequest("s", prompt, join_step=0, outputs=list(alone.outputs[:5]))
    drive(make_runner(tiny_model), [resumed], NUM_NEW_TOKENS, seeded)
    assert resumed.outputs == alone.outputs
    assert len(set(alone.outputs)) > 1  # sampled, not a greedy rut


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_invalid_steps_raise_and_change_nothing(tiny_model: Path) -> None:
    runner = make_runner(tiny_model, num_blocks=8)
    prompt = random_prompt(6, runner.info().vocab_size, 7)
    runner.execute_step(
        SchedulerOutput(
            0, [NewRequestData("a", prompt, 6, [0, 1], 0, GREEDY)], num_scheduled_tokens={"a": 6}
        )
    )
    before = (list(runner.requests["a"].token_ids), list(runner.requests["a"].block_ids))
    cache_before = [c.clone() for c in runner.kv_caches]
    bad_steps = {
        "unknown request": SchedulerOutput(1, num_scheduled_tokens={"zzz": 1}),
        "unknown request 'zzz' in cached": SchedulerOutput(
            1, cached_requests=[CachedRequestData("zzz", [], 0)]
        ),
        "outside 0..7": SchedulerOutput(
            1, [NewRequestData("b", prompt, 6, [0, 8], 0, GREEDY)], num_scheduled_tokens={"b": 6}
        ),
        "only 7 tokens are known": SchedulerOutput(
            1, cached_requests=[CachedRequestData("a", [], 6, [5])], num_scheduled_tokens={"a": 2}
        ),
        "cannot hold": SchedulerOutput(
            1, [NewRequestData("b", prompt, 6, [2], 0, GREEDY)], num_scheduled_tokens={"b": 6}
        ),
        "token id outside": SchedulerOutput(
            1, [NewRequestData("b", [10**6], 1, [2], 0, GREEDY)], num_scheduled_tokens={"b": 1}
        ),
        # "a" is dropped first, so continuing it in the same step is an unknown request.
        "unknown request 'a'": SchedulerOutput(
            1,
            cached_requests=[CachedRequestData("a", [], 6)],
            num_scheduled_tokens={"a": 1},
            finished_request_ids=["a"],
        ),
    }
    for message, step in bad_steps.items():
        with pytest.raises(ValueError, match=message):
            runner.execute_step(step)
    assert runner.requests.keys() == {"a"}
    assert (runner.requests["a"].token_ids, runner.requests["a"].block_ids) == before
    assert all(torch.equal(a, b) for a, b in zip(cache_before, runner.kv_caches, strict=True))
    # And a valid continuation still works afterwards.
    output = runner.execute_step(
        SchedulerOutput(
            2, cached_requests=[CachedRequestData("a", [], 6, [5])], num_scheduled_tokens={"a": 1}
        )
    )
    assert set(output.sampled) == {"a"} and output.forward_time_ms > 0


HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_half_precision_logprobs_match_transformers_within_its_own_rounding(
    arch: str, dtype: str, tmp_path: Path
) -> None:
    """bf16/fp16 against transformers in the same dtype, within twice transformers' own
    distance from its fp32 run (`half_precision_references` derives the bounds). Greedy
    tokens may part only at a near-tie under 2 x the logit noise, with our token in their
    top 2. The worst case is printed."""
    from transformers import AutoModelForCausalLM

    folder = write_realistic_model(tmp_path / arch, arch, seed=11)
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(folder), dtype=dtype, block_size=BLOCK_SIZE, num_blocks=48)
    )
    assert runner.info().dtype == dtype
    assert all(cache.dtype == HALF_DTYPES[dtype] for cache in runner.kv_caches)
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_half = AutoModelForCausalLM.from_pretrained(folder, dtype=HALF_DTYPES[dtype]).eval()
    vocab_size = runner.info().vocab_size
    requests = [
        ScriptedRequest(
            f"r{i}",
            random_prompt(n, vocab_size, 20 + i),
            join_step=i,
            prefill_chunk=5 if i == 0 else None,
        )
        for i, n in enumerate((11, 4, 23))
    ]
    drive(runner, requests, NUM_NEW_TOKENS, SamplingParams(temperature=0.0, num_logprobs=5))
    references = half_precision_references(
        hf32, hf_half, [r.prompt for r in requests], NUM_NEW_TOKENS
    )
    worst = 0.0
    for r, reference in zip(requests, references):
        entries = [_as_token_logprob(s) for s in r.sampled]
        worst = max(worst, assert_half_precision_close(r.outputs, entries, reference))
    print(
        f"{arch} {dtype}: worst logprob difference {worst:.2e}, "
        f"bound 2 x noise {references[0].logprob_bound:.2e}"
    )


def _with_rope_theta_scaled(config: dict, factor: float) -> None:
    config["rope_parameters"]["rope_theta"] *= factor


SMALL_BUGS = {  # a config our loader could misread, each a change of ~1% or less in a layer
    "norm epsilon x10": lambda config: config.update(rms_norm_eps=10 * config["rms_norm_eps"]),
    "rotary theta +1%": lambda config: _with_rope_theta_scaled(config, 1.01),
}


@pytest.mark.parametrize("bug", list(SMALL_BUGS))
def test_the_parity_check_catches_a_small_numerical_bug(bug: str, tmp_path: Path) -> None:
    """The check is only worth its bound if it fails on a real but small error: the runner
    given a subtly wrong config (as a loader bug would) must fail `assert_logprobs_close`
    against transformers on the true one, on realistic weights, in fp32."""
    from transformers import AutoModelForCausalLM

    folder = write_realistic_model(tmp_path / "true", "llama", seed=11)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    config = json.loads((broken / "config.json").read_text())
    SMALL_BUGS[bug](config)
    (broken / "config.json").write_text(json.dumps(config))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def runs(path: Path) -> list[ScriptedRequest]:
        vocab_size = hf_model.config.vocab_size
        requests = [
            ScriptedRequest(f"r{i}", random_prompt(n, vocab_size, 60 + i), join_step=0)
            for i, n in enumerate((13, 29))
        ]
        drive(
            make_runner(path),
            requests,
            NUM_NEW_TOKENS,
            SamplingParams(temperature=0.0, num_logprobs=5),
        )
        return requests

    def check(requests: list[ScriptedRequest]) -> None:
        for r in requests:
            assert_logprobs_close(
                r.outputs,
                [_as_token_logprob(s) for s in r.sampled],
                *hf_greedy_with_logits(hf_model, r.prompt, NUM_NEW_TOKENS),
            )

    check(runs(folder))  # the true config passes
    with pytest.raises(AssertionError, match="logprobs differ from transformers|near-tie"):
        check(runs(broken))


@dataclass(frozen=True)
class _TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class _TokenLogprob:
    token_id: int
    logprob: float
    top: list[_TopLogprob]


def _as_token_logprob(sampled: SampledToken) -> _TokenLogprob:
    """A runner's `SampledToken` in the shape the mesh returns (`TokenLogprob`)."""
    return _TokenLogprob(
        sampled.token_id, sampled.logprob, [_TopLogprob(t, lp) for t, lp in sampled.top_logprobs]
    )
