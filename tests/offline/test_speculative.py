"""Speculative decoding through the offline `LLM` (`speculative_config`, vLLM's): the
default model asked to copy code with a change keeps most of its n-gram drafts, and every
request gives the tokens and logprobs it gives without speculation: greedy, seeded samples,
n = 2, a JSON-constrained request beside them, and a regex-constrained request whose output
repeats itself (its drafts are verified under its grammar). At tp = 2 the
drafts are verified across the ranks the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.spec_decode import FUNCTIONS
from pagemesh import LLM, SamplingParams
from pagemesh.tools.testing.tiny_models import write_tiny_model

CODE = FUNCTIONS[0][2]  # a merge of sorted lists, 13 lines
MESSAGES = [
    {
        "role": "user",
        "content": "Rename the function merge_sorted to merge_lists in "
        "this code and print the whole code:\n\n" + CODE,
    }
]
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def answers(llm: LLM) -> list[tuple[list[int], list[float]]]:
    greedy = SamplingParams(temperature=0, max_tokens=64, logprobs=1)
    seeded = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=40, logprobs=1, n=2)
    constrained = SamplingParams(temperature=0, max_tokens=32, structured_outputs={"json": SCHEMA})
    outputs = [
        *llm.chat([MESSAGES], greedy, use_tqdm=False),
        *llm.chat([MESSAGES], seeded, use_tqdm=False),
        *llm.chat(
            [[{"role": "user", "content": "Give a name as JSON."}]], constrained, use_tqdm=False
        ),
    ]
    return [
        (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])])
        for o in outputs
        for c in o.outputs
    ]


def constrained_repeat(llm: LLM) -> tuple[list[int], list[float], int]:
    """A regex that makes the output repeat itself: n-gram drafts come from its own output,
    and are verified under the grammar. Its tokens, logprobs, and the drafts verified."""
    before = drafts_kept(llm)[0]
    params = SamplingParams(
        temperature=0,
        max_tokens=48,
        logprobs=1,
        structured_outputs={"regex": r"(merge_sorted\(left, right\); ){4}"},
    )
    (output,) = llm.chat([MESSAGES], params, use_tqdm=False)
    (choice,) = output.outputs
    after = drafts_kept(llm)[0]
    return (
        list(choice.token_ids),
        [lp[t].logprob for t, lp in zip(choice.token_ids, choice.logprobs or [])],
        after - before,
    )


def drafts_kept(llm: LLM) -> tuple[int, int]:
    scheduler = llm._engine.engine_loop.scheduler
    stats = scheduler.stats()
    return stats.num_draft_tokens, stats.num_accepted_tokens


def test_ngram_drafts_change_no_token_and_are_mostly_kept_on_a_copy(smollm2_gguf: Path) -> None:
    with LLM(str(smollm2_gguf), dtype="float32") as plain:
        expected = answers(plain)
        expected_repeat = constrained_repeat(plain)
    with LLM(str(smollm2_gguf), dtype="float32", speculative_config=NGRAM) as speculating:
        got = answers(speculating)
        drafted, kept = drafts_kept(speculating)
        repeat = constrained_repeat(speculating)
    assert repeat[0] == expected_repeat[0] and repeat[2] > 0
    assert repeat[1] == pytest.approx(expected_repeat[1], abs=1e-4)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, reference) in zip(got, expected):
        assert logprobs == pytest.approx(reference, abs=1e-4)
    assert kept > 25 and kept / drafted > 0.5, (drafted, kept)


def test_drafts_verified_across_two_tensor_parallel_ranks(tmp_path: Path) -> None:
    """A tiny random model copies nothing, so with one-token n-grams most drafts are rejected:
    the rollback is what is under test here."""
    model = write_tiny_model(tmp_path / "tiny", "llama", seed=3)
    prompts = [
        {"prompt_token_ids": [5, 17, 33, 101, 7, 250, 3] * 5},
        {"prompt_token_ids": [9, 8, 7, 6, 5, 4, 3, 2] * 4},
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    outputs = []
    for spec in (None, {**NGRAM, "prompt_lookup_min": 1}):
        with LLM(
            str(model), dtype="float32", tensor_parallel_size=2, speculative_config=spec
        ) as llm:
            outputs.append(
                [
                    list(o.outputs[0].token_ids)
                    for o in llm.generate(prompts, params, use_tqdm=False)
                ]
            )
            if spec is not None:
                assert drafts_kept(llm)[0] > 0
    assert outputs[0] == outputs[1]


def test_a_bad_speculative_config_is_refused_before_loading(smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match="not served"):
        LLM(str(smollm2_gguf), speculative_config={"method": "medusa", "num_speculative_tokens": 2})
