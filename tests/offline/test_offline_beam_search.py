"""`LLM.beam_search` (vLLM's) through the engine equals transformers' `generate(num_beams=...,
length_penalty=...)` on the same tiny model, several prompts in one call, beams ending by
EOS (the model's config names a token it likes as a second EOS) and by length; the beams
share their KV through the prefix cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh import LLM, BeamSearchParams
from pagemesh.tools.testing.tiny_models import write_tiny_model

PROMPTS = [
    [5, 17, 33, 101, 7, 250, 3, 9],
    [44, 2, 91, 300, 12, 12, 61, 8, 140, 77, 19, 23, 5, 6, 7, 8, 9, 10, 11, 12],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tiny_model(tmp_path_factory.mktemp("beam") / "tiny", "llama", seed=5)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        liked = int(model(torch.tensor([PROMPTS[0]])).logits[0, -1].argmax())
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], liked]
    (path / "config.json").write_text(json.dumps(config))
    for extra in path.glob("generation_config.json"):
        extra.unlink()
    return path


def reference(
    model_dir: Path, prompt: list[int], params: BeamSearchParams, eos: list[int]
) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            do_sample=False,
            length_penalty=params.length_penalty,
            eos_token_id=eos,
            pad_token_id=0,
            max_new_tokens=params.max_tokens,
        )
    beams = []
    for sequence in out[:, len(prompt) :].tolist():
        end = next((i + 1 for i, token in enumerate(sequence) if token in eos), len(sequence))
        beams.append(sequence[:end])
    return beams


# A length penalty under 1 favours the short beams that ended with EOS.
@pytest.mark.parametrize(
    "width,length_penalty,ends", [(3, 1.0, False), (2, 0.5, True), (4, 0.0, True)]
)
def test_llm_beam_search_equals_transformers(
    model_dir: Path, width: int, length_penalty: float, ends: bool
) -> None:
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty)
    with LLM(str(model_dir), dtype="float32", block_size=4) as llm:
        eos = llm.limits.eos_token_ids
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        hits = llm._engine.engine_loop.scheduler.kv.prefix_cache_hits  # type: ignore[union-attr]
    assert len(eos) == 2
    reasons = []
    for prompt, output in zip(PROMPTS, outputs):
        got = [sequence.tokens[len(prompt) :] for sequence in output.sequences]
        assert got == reference(model_dir, prompt, params, eos)
        for sequence in output.sequences:
            assert sequence.tokens[: len(prompt)] == prompt
            assert sequence.cum_logprob == pytest.approx(
                sum(
                    lp[t].logprob
                    for t, lp in zip(sequence.tokens[len(prompt) :], sequence.logprobs)
                )
            )
            reasons.append(sequence.finish_reason)
    assert ("stop" in reasons) == ends and "length" in reasons
    assert hits > 0


def test_beam_search_refuses_what_it_cannot_do(model_dir: Path) -> None:
    with LLM(str(model_dir), dtype="float32") as llm:
        with pytest.raises(ValueError, match="beam_width <= 6"):
            llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=8, max_tokens=4))
        with pytest.raises(ValueError, match="context"):
            llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=10**6))
