"""Structured output in the runner: constrained greedy tokens equal transformers' with the
same grammar's mask applied by a logits processor, every output validates, and a request
rebuilt half-way from its outputs (a resume, a preemption) continues inside its grammar
exactly as the undisturbed run did."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from pagemesh.options.constraint import OutputConstraint
from pagemesh.testing.tiny_models import write_realistic_model
from protos.step import SamplingParams, SchedulerOutput
from router.structured import llguidance_tokenizer, to_grammar
from tests.support.hf_reference import assert_greedy_close
from tests.support.runner_script import ScriptedRequest, drive, random_prompt
from tests.support.structured_reference import hf_constrained
from worker_svc.runner import ModelRunner, RunnerConfig

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}},
    "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": OutputConstraint("json_schema", json.dumps(SCHEMA)),
    "regex": OutputConstraint("regex", r"(yes|no), [0-9]{2,4}\."),
    "choice": OutputConstraint("choice", ("Paris", "Berlin", "Rome")),
    "grammar": OutputConstraint("grammar", 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'),
}
NUM_TOKENS = 80
EOS = 0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_realistic_model(tmp_path_factory.mktemp("structured") / "llama", "llama", seed=5)


@pytest.fixture(scope="module")
def hf_model(model: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()


def up_to_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def llg_tokenizer(model: Path, vocab_size: int) -> object:
    from transformers import AutoTokenizer

    return llguidance_tokenizer(AutoTokenizer.from_pretrained(model), vocab_size, [EOS])


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_equals_transformers_with_the_same_mask(
        kind: str, model: Path, hf_model: torch.nn.Module) -> None:
    runner = ModelRunner.from_config(RunnerConfig(model_path=str(model), block_size=4,
                                                  num_blocks=96))
    vocab_size = runner.info().vocab_size
    grammar = to_grammar(CONSTRAINTS[kind])
    sampling = SamplingParams(temperature=0.0, grammar=grammar, num_logprobs=0)
    requests = [ScriptedRequest(f"r{i}", random_prompt(5 + 4 * i, vocab_size, 70 + i),
                                join_step=i) for i in range(3)]
    drive(runner, requests, NUM_TOKENS, sampling)
    tokenizer = llg_tokenizer(model, vocab_size)
    decode = tokenizer.decode_str  # type: ignore[attr-defined]
    for r in requests:
        ours = up_to_eos(r.outputs)
        assert ours[-1] == EOS, f"{kind}: the grammar never completed in {NUM_TOKENS} tokens"
        reference, logits = hf_constrained(hf_model, tokenizer, grammar, r.prompt, NUM_TOKENS,
                                           [EOS])
        if len(ours) == len(reference):
            assert_greedy_close(ours, reference, logits)
        else:
            assert_greedy_close(ours[:len(reference)], reference, logits[:len(reference)])
        text = decode(ours[:-1])
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "choice":
            assert text in CONSTRAINTS["choice"].value


def test_a_rebuilt_request_continues_inside_its_grammar(model: Path) -> None:
    """Half-way, the request is dropped and sent again with its outputs (what a preemption
    or a resume on another group does): the matcher catches up over them, and the rest is
    the undisturbed run's, token for token."""
    runner = ModelRunner.from_config(RunnerConfig(model_path=str(model), block_size=4,
                                                  num_blocks=64))
    sampling = SamplingParams(temperature=0.7, seed=11, top_k=20,
                              grammar=to_grammar(CONSTRAINTS["json_schema"]))
    prompt = random_prompt(9, runner.info().vocab_size, 90)
    whole = ScriptedRequest("r", prompt, join_step=0)
    drive(runner, [whole], NUM_TOKENS, sampling)
    runner.execute_step(SchedulerOutput(999, finished_request_ids=["r"]))
    resumed = ScriptedRequest("r", prompt, join_step=0, prefill_chunk=6,
                              outputs=list(whole.outputs[:7]))
    drive(runner, [resumed], NUM_TOKENS, sampling)
    assert resumed.outputs == whole.outputs
    text = llg_tokenizer(model, runner.info().vocab_size).decode_str(  # type: ignore[attr-defined]
        up_to_eos(whole.outputs)[:-1])
    jsonschema.validate(json.loads(text), SCHEMA)
