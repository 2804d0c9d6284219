"""The correctness bar: greedy tokens and logprobs from Hugging Face `transformers` on the
same weights, and the bounds within which ours must lie (fp32, and bf16/fp16 derived from
transformers' own rounding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4  # top-2 logit gap under which either token is a correct greedy choice


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """`generate(do_sample=False)` for exactly `max_new_tokens` tokens (EOS does not stop it)."""
    input_ids = torch.tensor([prompt_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids) :].tolist()


@torch.inference_mode()
def hf_greedy_with_logits(
    model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """`hf_greedy`, with the logits of every step ([max_new_tokens, vocab_size])."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    assert len(tokens) == max_new_tokens
    return tokens, torch.stack([step_logits[0] for step_logits in out.logits])


def assert_near_tie(
    index: int,
    ours: int,
    reference: int,
    reference_logits: torch.Tensor,
    bound: float = NEAR_TIE,
    context: str = "",
) -> None:
    """The one near-tie rule (as vLLM's check_logprobs_close): where our greedy token differs
    from the reference's, the reference's top-2 logits there must be within `bound` and our
    token must be one of those two."""
    top = torch.topk(reference_logits.float(), 2)
    gap = float(top.values[0] - top.values[1])
    assert gap < bound and ours in top.indices.tolist(), (
        f"diverged at output token {index}: ours {ours}, transformers {reference}; top-2 "
        f"{top.indices.tolist()} with gap {gap:.3g} is not a near-tie (bound {bound:g}){context}"
    )


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    assert len(ours) == len(reference), f"{len(ours)} tokens vs {len(reference)}"
    return next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)


def assert_greedy_close(
    ours: list[int], reference: list[int], reference_logits: torch.Tensor
) -> None:
    """Token-for-token equality up to a near-tie at the first divergence, given the
    reference's logits per step; nothing after it is compared (the continuations differ)."""
    i = first_divergence(ours, reference)
    if i is not None:
        assert_near_tie(
            i,
            ours[i],
            reference[i],
            reference_logits[i],
            context=f"\nours: {ours}\nref:  {reference}",
        )


@torch.inference_mode()
def assert_greedy_match(
    model: torch.nn.Module, prompt_ids: list[int], ours: list[int], reference: list[int]
) -> None:
    """`assert_greedy_close`, computing the reference's logits at the divergence only."""
    i = first_divergence(ours, reference)
    if i is not None:
        logits = model(torch.tensor([prompt_ids + reference[:i]])).logits[0, -1]
        assert_near_tie(
            i, ours[i], reference[i], logits, context=f"\nours: {ours}\nref:  {reference}"
        )


LOGPROB_BOUND_FP32 = 1e-4  # |our logprob - transformers'| in fp32 (nats)


def assert_logprobs_close(
    ours: list[int],
    our_logprobs: list,
    reference: list[int],
    reference_logits: torch.Tensor,
    bound: float = LOGPROB_BOUND_FP32,
    tie_bound: float = NEAR_TIE,
) -> float:
    """Our greedy tokens with their logprobs (`TokenLogprob`s: the chosen token's logprob and
    the top alternatives) against transformers' tokens and per-step logits.

    Up to the first divergence every step's logprobs must equal `log_softmax` of the
    reference's logits within `bound`: the chosen token's, and each of our top-k, both by id
    and rank by rank (so the top-k ids agree up to ties within `bound`). At the divergence
    the near-tie rule applies; after it the contexts differ and nothing is compared.
    Returns the worst difference seen."""
    assert len(our_logprobs) == len(ours), (
        f"{len(our_logprobs)} logprob entries, {len(ours)} tokens"
    )
    diverged = first_divergence(ours, reference)
    worst = 0.0
    for i in range(len(ours) if diverged is None else diverged):
        ref = torch.log_softmax(reference_logits[i].double(), dim=-1)
        entry = our_logprobs[i]
        assert entry.token_id == ours[i], (i, entry.token_id, ours[i])
        diffs = [abs(entry.logprob - float(ref[ours[i]]))]
        top = [(t.token_id, t.logprob) for t in entry.top]
        ref_values = ref.topk(len(top)).values.tolist() if top else []
        for (token_id, logprob), ref_value in zip(top, ref_values):
            diffs += [abs(logprob - float(ref[token_id])), abs(logprob - ref_value)]
        worst = max(worst, *diffs)
        assert max(diffs) <= bound, (
            f"output token {i}: logprobs differ from transformers' by {max(diffs):.3g} "
            f"(bound {bound:g}); ours {entry.logprob:.6f} top {top}, "
            f"transformers {float(ref[ours[i]]):.6f} top {ref_values}"
        )
    if diverged is not None:
        assert_near_tie(
            diverged,
            ours[diverged],
            reference[diverged],
            reference_logits[diverged],
            tie_bound,
            f"\nours: {ours}\nref:  {reference}",
        )
    return worst


NOISE_TOP_K = 20  # the half-precision noise is measured over this many likeliest tokens a step


@dataclass(frozen=True)
class HalfPrecisionReference:
    """transformers' greedy run in bf16/fp16 of one prompt, and the bounds ours is held to.

    The bounds are derived, not guessed. `noise` is how far transformers' half-precision
    logprobs (and logits) lie from its own fp32 run on the same context: the largest over
    every step's NOISE_TOP_K likeliest tokens (where the compared entries, the chosen token
    and the top-5, lie; the vocabulary's tail is rounded far more coarsely), over every
    prompt of the workload (the noise is the model's and dtype's, not one prompt's; a
    single prompt's sample is too small to be stable). Ours and theirs round
    independently, so an implementation as exact as theirs lies within 2 x noise of theirs
    (+ 1e-5 for our fp32 log_softmax)."""

    tokens: list[int]
    logits: torch.Tensor  # [num_tokens, vocab_size], transformers' in the half dtype
    logprob_bound: float  # nats
    tie_bound: float  # a logit gap: a divergence under it is a near-tie


@torch.inference_mode()
def half_precision_references(
    hf32: torch.nn.Module, hf_half: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[HalfPrecisionReference]:
    """`hf_half`'s greedy tokens and logits for each prompt, bounded by its distance from
    `hf32` (the same weights in fp32) teacher-forced on the half-precision continuations."""
    runs, logprob_noise, logit_noise = [], 0.0, 0.0
    for prompt_ids in prompts:
        tokens, logits = hf_greedy_with_logits(hf_half, prompt_ids, max_new_tokens)
        logits32 = hf32(torch.tensor([prompt_ids + tokens])).logits[0, len(prompt_ids) - 1 : -1]
        logits32, half = logits32.double(), logits.double()
        likeliest = logits32.topk(min(NOISE_TOP_K, logits32.shape[-1]), dim=-1).indices
        logprob_gap = torch.log_softmax(half, -1) - torch.log_softmax(logits32, -1)
        logprob_noise = max(logprob_noise, float(logprob_gap.gather(-1, likeliest).abs().max()))
        logit_noise = max(logit_noise, float((half - logits32).gather(-1, likeliest).abs().max()))
        runs.append((tokens, logits))
    return [
        HalfPrecisionReference(tokens, logits, 2 * logprob_noise + 1e-5, 2 * logit_noise)
        for tokens, logits in runs
    ]


def assert_half_precision_close(
    ours: list[int], our_logprobs: list, reference: HalfPrecisionReference
) -> float:
    """`assert_logprobs_close` within the reference's derived bounds; the worst difference."""
    return assert_logprobs_close(
        ours,
        our_logprobs,
        reference.tokens,
        reference.logits,
        reference.logprob_bound,
        reference.tie_bound,
    )
