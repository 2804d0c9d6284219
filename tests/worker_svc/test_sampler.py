"""Sampling: counter-based seeding, filters, penalties, min_tokens and logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from protos.step import SamplingParams
from worker_svc.sampler import SamplingRow, _splitmix64, mix_seed, sample


def req(params: SamplingParams, prompt=(), output=()) -> SamplingRow:
    return SamplingRow(params, [*prompt, *output], num_prompt_tokens=len(prompt))


def random_logits(num_rows: int, vocab_size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_mix_seed_is_stable_across_processes() -> None:
    # Fixed values: any change breaks resumed requests and cross-worker reproducibility.
    assert _splitmix64(0) == 0xE220A8397B1DCDAF  # the published splitmix64 first output
    assert mix_seed(0, 0) == 0x53836E97A68CBF37
    assert [mix_seed(1234, i) for i in range(3)] == [
        5695911890728328310,
        2402035077595190771,
        4665392658189219966,
    ]
    assert len({mix_seed(seed, i) for seed in range(20) for i in range(20)}) == 400
    assert all(0 <= mix_seed(s, i) < 2**63 for s in (0, -1, 2**64 - 1) for i in (0, 10**9))


def test_seeded_draw_is_independent_of_batch_composition() -> None:
    logits = random_logits(4)
    params = SamplingParams(temperature=1.0, seed=42)
    others = [SamplingParams(temperature=0.7, top_p=0.9, seed=7), SamplingParams(temperature=0.0)]
    for output_len in range(10):
        output = [1] * output_len
        alone = sample(logits[:1], [req(params, output=output)])[0].token_id
        batch = sample(
            torch.stack([logits[1], logits[0], logits[2]]),
            [req(others[0]), req(params, output=output), req(others[1])],
        )
        assert batch[1].token_id == alone


def test_different_output_index_or_seed_changes_the_draw() -> None:
    logits = torch.zeros(1, 1000)  # uniform: repeats would be a coincidence
    draws = {
        sample(logits, [req(SamplingParams(seed=5), output=[0] * i)])[0].token_id for i in range(20)
    }
    assert len(draws) > 15
    seeds = {sample(logits, [req(SamplingParams(seed=s))])[0].token_id for s in range(20)}
    assert len(seeds) > 15


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    num_draws = 4000
    logits = probs.log().expand(num_draws, -1)
    tokens = sample(logits, [req(SamplingParams(seed=s)) for s in range(num_draws)])
    counts = torch.bincount(torch.tensor([t.token_id for t in tokens]), minlength=4)
    torch.testing.assert_close(counts / num_draws, probs, atol=0.03, rtol=0)


def test_greedy_and_top_k_1_are_argmax() -> None:
    logits = random_logits(8, seed=1)
    greedy = sample(logits, [req(SamplingParams(temperature=0.0))] * 8)
    top1 = sample(logits, [req(SamplingParams(temperature=1.5, top_k=1, seed=s)) for s in range(8)])
    expected = logits.argmax(-1).tolist()
    assert [t.token_id for t in greedy] == expected
    assert [t.token_id for t in top1] == expected


def test_noop_penalties_do_not_perturb_greedy() -> None:
    # A near-tie between tokens 3 and 4 that any arithmetic on the row could flip.
    logits = torch.zeros(1, 8)
    logits[0, 3], logits[0, 4] = 1.0, 1.0 - 1e-6
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0
    )
    assert sample(logits, [req(params, prompt=[3, 4], output=[3])])[0].token_id == 3


@pytest.mark.parametrize(
    "params,allowed",
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 + 0.3 reaches 0.7
        (SamplingParams(top_p=0.4), {0}),
        (SamplingParams(min_p=0.5), {0, 1}),  # p >= 0.25
        (SamplingParams(min_p=0.25), {0, 1, 2}),
    ],
)
def test_filters_restrict_the_support(params: SamplingParams, allowed: set[int]) -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seen = {
        sample(logits, [req(dataclasses.replace(params, seed=s))])[0].token_id for s in range(300)
    }
    assert seen == allowed


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.1, 0.0]])
    penalty = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    # Positive seen logit is divided: 2.0 / 1.2 < 1.9.
    assert sample(logits, [req(penalty, prompt=[0])])[0].token_id == 1
    # Negative seen logit is multiplied: among the negatives, -1.0 * 1.2 < -1.1.
    negatives = torch.tensor([[-1.0, -1.1]])
    assert sample(negatives, [req(penalty, output=[0])])[0].token_id == 1
    assert sample(negatives, [req(penalty)])[0].token_id == 0


def test_presence_and_frequency_count_output_only() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert sample(logits, [req(frequency, output=[0])])[0].token_id == 0  # 2.7 > 2.5
    assert sample(logits, [req(frequency, output=[0, 0])])[0].token_id == 1  # 2.4 < 2.5
    assert sample(logits, [req(frequency, prompt=[0] * 10)])[0].token_id == 0  # prompt free
    presence = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert sample(logits, [req(presence, output=[0])])[0].token_id == 1
    small_presence = SamplingParams(temperature=0.0, presence_penalty=0.4)
    assert sample(logits, [req(small_presence, output=[0] * 5)])[0].token_id == 0


def test_min_tokens_masks_stop_ids_until_reached() -> None:
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(0, 2))
    assert sample(logits, [req(params, output=[])])[0].token_id == 1
    assert sample(logits, [req(params, output=[3])])[0].token_id == 1
    assert sample(logits, [req(params, output=[3, 3])])[0].token_id == 0
    random_params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=(0, 2))
    drawn = {
        sample(logits, [req(dataclasses.replace(random_params, seed=s))])[0].token_id
        for s in range(100)
    }
    assert drawn.isdisjoint({0, 2})


def test_logprobs_come_from_raw_logits() -> None:
    logits = random_logits(3, seed=2)
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.0, num_logprobs=5),
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, seed=3, num_logprobs=2),
        SamplingParams(temperature=1.0, seed=4),
    ]
    tokens = sample(logits, [req(p, prompt=[1, 2, 3]) for p in params])
    for row, token in enumerate(tokens):
        n = params[row].num_logprobs
        # Only rows that asked for logprobs get them (the client sees them only then).
        expected_logprob = float(raw[row, token.token_id]) if n else 0.0
        assert math.isclose(token.logprob, expected_logprob, abs_tol=1e-6)
        top = raw[row].topk(n) if n else None
        assert len(token.top_logprobs) == n
        if top is not None:
            assert [t for t, _ in token.top_logprobs] == top.indices.tolist()
            for (_, value), expected in zip(token.top_logprobs, top.values.tolist(), strict=True):
                assert math.isclose(value, expected, abs_tol=1e-6)


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="2 logit rows for 1 requests"):
        sample(torch.zeros(2, 4), [req(SamplingParams())])


def test_constrained_rows_draw_what_the_masked_logits_give_alone() -> None:
    """A batch mixing every path: constrained greedy (read straight from the bits),
    constrained greedy with a penalty and constrained sampled (mask applied to a copy), and
    unconstrained rows, equals each row sampled alone from logits already masked; the
    logprobs stay those of the unmasked logits."""
    from kernels.cpu_fused import apply_token_bitmask_reference_
    from worker_svc.sampler import RowMasks

    logits = random_logits(5, vocab_size=100, seed=3)
    params = [
        SamplingParams(temperature=0.0, num_logprobs=2),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, top_k=5, seed=8),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=9),
    ]
    rows = [req(p, prompt=[1, 2], output=[4]) for p in params]
    constrained = [0, 1, 2]
    bits = torch.randint(
        -(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=torch.Generator().manual_seed(4)
    )
    batch = sample(logits, rows, RowMasks(constrained, bits))
    masked = logits.clone()
    apply_token_bitmask_reference_(masked, constrained, bits)
    for row in range(5):
        alone = sample(masked[row : row + 1], [rows[row]])[0]
        assert batch[row].token_id == alone.token_id, row
        if row in constrained:
            assert not torch.isinf(masked[row, batch[row].token_id])
    expected = torch.log_softmax(logits[0], -1)[batch[0].token_id].item()
    assert batch[0].logprob == pytest.approx(expected, abs=1e-6)
