"""transformers' side of structured output: greedy generation with a grammar's mask applied
by a logits processor with its own llguidance matcher (per row, llguidance's plain
`compute_bitmask`), so that ours, batched and resumable, can be compared with it token for
token."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class GrammarProcessor:
    """A transformers logits processor: -inf for every token the grammar does not allow
    after the output so far."""

    def __init__(self, tokenizer: object, grammar: str, num_prompt_tokens: int) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_consumed = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        output = input_ids[0, self.num_prompt_tokens :].tolist()
        assert self.matcher.consume_tokens(output[self.num_consumed :]), self.matcher.get_error()
        self.num_consumed = len(output)
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: scores.shape[-1]].astype(bool)
        return scores.masked_fill(~torch.from_numpy(allowed), float("-inf"))


@torch.inference_mode()
def hf_constrained(
    hf_model: torch.nn.Module,
    tokenizer: object,
    grammar: str,
    prompt: list[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens under `grammar` (up to and including the first EOS), and the masked
    scores of each step (a near-tie is judged among the tokens the grammar allows)."""
    from transformers import LogitsProcessorList

    eos = list(eos_token_ids)
    out = hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos[0],
        output_scores=True,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([GrammarProcessor(tokenizer, grammar, len(prompt))]),
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    ends = [i for i, t in enumerate(tokens) if t in eos]
    tokens = tokens[: ends[0] + 1] if ends else tokens
    return tokens, torch.stack([step[0] for step in out.scores])[: len(tokens)]
