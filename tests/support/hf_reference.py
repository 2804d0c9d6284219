"""The correctness bar: greedy tokens from Hugging Face `transformers` on the same weights."""

from __future__ import annotations

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
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def assert_greedy_match(model: torch.nn.Module, prompt_ids: list[int], ours: list[int],
                        reference: list[int]) -> None:
    """Equal token for token, or equal up to a demonstrated near-tie (as vLLM's
    check_logprobs_close): at the first divergence the reference's top-2 logits must be
    within NEAR_TIE and our token must be one of them. Nothing after it is compared.
    """
    assert len(ours) == len(reference), f"{len(ours)} tokens vs {len(reference)}"
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a == b:
            continue
        logits = model(torch.tensor([prompt_ids + reference[:i]])).logits[0, -1].float()
        top = torch.topk(logits, 2)
        gap = float(top.values[0] - top.values[1])
        assert gap < NEAR_TIE and a in top.indices.tolist(), (
            f"diverged at output token {i}: ours {a}, transformers {b}; top-2 gap {gap:.3g} "
            f"is not a near-tie\nours: {ours}\nref:  {reference}"
        )
        return
