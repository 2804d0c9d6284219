"""Draft-model speculative decoding through the offline `LLM` (vLLM's `speculative_config=
{"model": ..., "num_speculative_tokens": k}`): the output equals decoding without
speculation, greedy, seeded samples, n = 2 and logprobs, whatever the draft; a draft that
is the served model itself has nearly every draft kept, which checks that the draft's KV
follows the target's step by step and its proposals continue the right tokens; a draft
with another vocabulary or tokenizer is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagemesh import LLM, SamplingParams
from pagemesh.tools.testing.tiny_models import write_tiny_model

PROMPTS = [
    {"prompt_token_ids": [5, 17, 33, 101, 7, 250, 3] * 3},
    {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 2] * 5},
    {"prompt_token_ids": [44, 45, 46]},
]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("draft") / "target", "llama", seed=3)


def outputs(llm: LLM) -> tuple[list[tuple[list[int], list[float]]], float]:
    """Greedy and seeded outputs (tokens, logprobs), and the share of greedy drafts kept."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(
        temperature=0.8, seed=7, max_tokens=30, ignore_eos=True, n=2, logprobs=1
    )
    results = llm.generate(PROMPTS, greedy, use_tqdm=False)
    scheduler = llm._engine.engine_loop.scheduler  # type: ignore[union-attr]
    drafted, kept = scheduler.stats().num_draft_tokens, scheduler.stats().num_accepted_tokens
    results += llm.generate(PROMPTS[:1], seeded, use_tqdm=False)
    assert drafted > 30 or scheduler.spec is None, drafted
    tokens = [
        (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        for r in results
        for c in r.outputs
    ]
    return tokens, kept / drafted if drafted else 0.0


def test_any_draft_changes_no_token_and_the_target_itself_is_always_right(
    target: Path, tmp_path: Path
) -> None:
    other = write_tiny_model(tmp_path / "other", "llama", seed=4, num_hidden_layers=1)
    with LLM(str(target), dtype="float32", block_size=4) as plain:
        expected, _ = outputs(plain)
    for draft, least_kept in ((target, 0.95), (other, 0.0)):
        with LLM(
            str(target),
            dtype="float32",
            block_size=4,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3},
        ) as speculating:
            got, kept = outputs(speculating)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, logprobs), (_, reference) in zip(got, expected):
            assert logprobs == pytest.approx(reference, abs=1e-4)
        assert kept >= least_kept, (draft, kept)


def test_a_draft_of_another_vocabulary_or_tokenizer_is_refused(
    target: Path, tmp_path: Path
) -> None:
    wider = write_tiny_model(tmp_path / "wider", "llama", seed=4, vocab_size=640)
    with pytest.raises(ValueError, match="vocabulary of 640"):
        LLM(str(target), speculative_config={"model": str(wider), "num_speculative_tokens": 2})
    renamed = tmp_path / "renamed"
    shutil.copytree(target, renamed)
    tokenizer = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[5:7]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (renamed / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="another tokenizer"):
        LLM(str(target), speculative_config={"model": str(renamed), "num_speculative_tokens": 2})
