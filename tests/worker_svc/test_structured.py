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

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.step import SamplingParams, SchedulerOutput
from router.structured import llguidance_tokenizer, to_grammar
from tests.support.hf_reference import assert_greedy_close
from tests.support.runner_script import ScriptedRequest, drive, random_prompt
from tests.support.structured_reference import hf_constrained
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
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
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def llg_tokenizer(model: Path, vocab_size: int) -> object:
    from transformers import AutoTokenizer

    return llguidance_tokenizer(AutoTokenizer.from_pretrained(model), vocab_size, [EOS])


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_equals_transformers_with_the_same_mask(
    kind: str, model: Path, hf_model: torch.nn.Module
) -> None:
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(model), block_size=4, num_blocks=96)
    )
    vocab_size = runner.info().vocab_size
    grammar = to_grammar(CONSTRAINTS[kind])
    sampling = SamplingParams(temperature=0.0, grammar=grammar, num_logprobs=0)
    requests = [
        ScriptedRequest(f"r{i}", random_prompt(5 + 4 * i, vocab_size, 70 + i), join_step=i)
        for i in range(3)
    ]
    drive(runner, requests, NUM_TOKENS, sampling)
    tokenizer = llg_tokenizer(model, vocab_size)
    decode = tokenizer.decode_str  # type: ignore[attr-defined]
    for r in requests:
        ours = up_to_eos(r.outputs)
        assert ours[-1] == EOS, f"{kind}: the grammar never completed in {NUM_TOKENS} tokens"
        reference, logits = hf_constrained(
            hf_model, tokenizer, grammar, r.prompt, NUM_TOKENS, [EOS]
        )
        if len(ours) == len(reference):
            assert_greedy_close(ours, reference, logits)
        else:
            assert_greedy_close(ours[: len(reference)], reference, logits[: len(reference)])
        text = decode(ours[:-1])
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "choice":
            assert text in CONSTRAINTS["choice"].value


def test_a_rebuilt_request_continues_inside_its_grammar(model: Path) -> None:
    """Half-way, the request is dropped and sent again with its outputs (what a preemption
    or a resume on another group does): the matcher catches up over them, and the rest is
    the undisturbed run's, token for token."""
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(model), block_size=4, num_blocks=64)
    )
    sampling = SamplingParams(
        temperature=0.7, seed=11, top_k=20, grammar=to_grammar(CONSTRAINTS["json_schema"])
    )
    prompt = random_prompt(9, runner.info().vocab_size, 90)
    whole = ScriptedRequest("r", prompt, join_step=0)
    drive(runner, [whole], NUM_TOKENS, sampling)
    runner.execute_step(SchedulerOutput(999, finished_request_ids=["r"]))
    resumed = ScriptedRequest(
        "r", prompt, join_step=0, prefill_chunk=6, outputs=list(whole.outputs[:7])
    )
    drive(runner, [resumed], NUM_TOKENS, sampling)
    assert resumed.outputs == whole.outputs
    text = llg_tokenizer(
        model, runner.info().vocab_size
    ).decode_str(  # type: ignore[attr-defined]
        up_to_eos(whole.outputs)[:-1]
    )
    jsonschema.validate(json.loads(text), SCHEMA)


def test_draft_rows_are_masked_as_if_each_draft_were_output(model: Path) -> None:
    """Speculative decoding: a constrained request's row after draft j is masked by the
    grammar once drafts[:j + 1] are output, its matcher is left where its output is (a
    rejected draft leaves no trace), and a row after a draft the grammar refuses allows
    only EOS (never kept, since that draft is rejected)."""
    from transformers import AutoTokenizer

    from worker_svc.structured import ConstrainedRow, GrammarVocabulary, token_bitmask

    vocab_size = (
        ModelRunner.from_config(RunnerConfig(model_path=str(model), block_size=4, num_blocks=8))
        .info()
        .vocab_size
    )
    vocabulary = GrammarVocabulary(str(model), vocab_size, (EOS,))
    grammar = to_grammar(CONSTRAINTS["regex"])
    ids = AutoTokenizer.from_pretrained(model).encode("yes, 123.", add_special_tokens=False)

    def masks_one_by_one(tokens: list[int]) -> list[torch.Tensor]:
        state = vocabulary.new_state(grammar)
        rows = []
        for end in range(len(tokens) + 1):
            rows.append(token_bitmask(vocabulary, [ConstrainedRow(0, state, tokens[:end])])[0])
        return rows

    state = vocabulary.new_state(grammar)
    drafted = token_bitmask(vocabulary, [ConstrainedRow(0, state, ids[:1], ids[1:])])
    expected = masks_one_by_one(ids)[1:]
    assert len(drafted) == len(ids) and all(torch.equal(a, b) for a, b in zip(drafted, expected))
    again = token_bitmask(vocabulary, [ConstrainedRow(0, state, ids[:1])])[0]
    assert torch.equal(again, expected[0])  # the drafts were not consumed
    allowed_after_two = expected[1].numpy().view("uint32")
    bad = next(t for t in range(1, vocab_size) if not allowed_after_two[t // 32] >> (t % 32) & 1)
    refused = token_bitmask(vocabulary, [ConstrainedRow(0, state, ids[:1], [ids[1], bad])])
    eos_only = torch.zeros_like(refused[0])
    eos_only[EOS // 32] = 1 << (EOS % 32)
    assert torch.equal(refused[1], expected[1]) and torch.equal(refused[2], eos_only)
