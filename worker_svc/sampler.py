"""Turn a batch of logits into tokens, one request's settings per row.

Order per row: raw logits -> logprobs (reported from the raw distribution) -> repetition,
presence and frequency penalties -> min_tokens stop masking -> the output constraint's mask
(structured output: only the tokens its grammar allows) -> greedy argmax, or temperature ->
top-k -> top-p -> min-p -> one seeded draw (the transformers warper order).

Randomness is counter-based: the draw for a request's i-th output token uses a generator
seeded with `mix_seed(seed, i)`, so a seed gives the same tokens whatever else shares the
batch, across processes and after a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_fused
from protos.step import SampledToken, SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix_seed(seed: int, output_index: int) -> int:
    """A stable 63-bit generator seed for drawing output token `output_index` of a request."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ output_index) >> 1


@dataclass(frozen=True)
class SamplingRow:
    """One row of the batch: its settings and the tokens penalties look at."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far (the runner's list, not copied)
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int:
        """Index of the token being drawn: the counter of the seeded draw."""
        return len(self.token_ids) - self.num_prompt_tokens

    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True)
class RowMasks:
    """The tokens constrained rows may draw: bitmask `bits[i]` for row `rows[i]`
    (worker_svc/structured.py computes them)."""

    rows: list[int]
    bits: (
        torch.Tensor
    )  # int32 [len(rows), ceil(vocab_size / 32)]; token t is bit t % 32 of word t // 32

    def bits_of(self, rows: list[int]) -> torch.Tensor:
        """The bitmasks of `rows`, in that order (no copy when that is all of them)."""
        if rows == self.rows:
            return self.bits
        position = {row: k for k, row in enumerate(self.rows)}
        return self.bits[[position[row] for row in rows]]


def sample(
    logits: torch.Tensor, requests: Sequence[SamplingRow], masks: RowMasks | None = None
) -> list[SampledToken]:
    """logits [num_rows, vocab_size] (any float dtype) -> one token per row.

    Rows without penalties, stop masking or a constraint are not copied, and greedy rows
    share one argmax: a batch of 64 plain greedy decodes costs a few batched ops, not 64
    per-row ones. Constrained greedy rows are not copied either: one C kernel reads their
    logits where their bits allow.
    """
    if logits.shape[0] != len(requests):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")
    logits = logits.to(torch.float32)
    to_process = [row for row, request in enumerate(requests) if _needs_processing(request)]
    direct, applied = _constrained_rows(requests, masks, set(to_process))
    processed = logits
    if to_process or applied:
        processed = logits.clone()
        for row in to_process:
            _apply_penalties(processed[row], requests[row])
            _mask_stop_tokens(processed[row], requests[row])
        if applied:
            cpu_fused.apply_token_bitmask_(processed, applied, masks.bits_of(applied))
    token_ids = [0] * len(requests)
    if direct:  # straight from the logits and the bits, no copy
        chosen = cpu_fused.argmax_masked(logits, direct, masks.bits_of(direct))
        for row, token_id in zip(direct, chosen.tolist(), strict=True):
            token_ids[row] = token_id
    direct_set = set(direct)
    greedy = [
        row
        for row, request in enumerate(requests)
        if request.params.temperature == 0.0 and row not in direct_set
    ]
    if greedy:
        rows = processed if len(greedy) == len(requests) else processed[greedy]
        for row, token_id in zip(greedy, cpu_fused.argmax(rows).tolist(), strict=True):
            token_ids[row] = token_id
    for row, request in enumerate(requests):
        if request.params.temperature != 0.0:
            token_ids[row] = _choose(processed[row], request)
    return _with_logprobs(logits, token_ids, requests)


def _constrained_rows(
    requests: Sequence[SamplingRow], masks: RowMasks | None, to_process: set[int]
) -> tuple[list[int], list[int]]:
    """Constrained rows split: greedy ones with nothing else to apply choose straight from
    the logits and their bits; the others get the mask applied to a copy."""
    if masks is None:
        return [], []
    direct = [
        row
        for row in masks.rows
        if requests[row].params.temperature == 0.0 and row not in to_process
    ]
    chosen = set(direct)
    return direct, [row for row in masks.rows if row not in chosen]


def _needs_processing(request: SamplingRow) -> bool:
    params = request.params
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or (bool(params.stop_token_ids) and request.num_output_tokens < params.min_tokens)
    )


def _apply_penalties(row: torch.Tensor, request: SamplingRow) -> None:
    params = request.params
    if params.repetition_penalty != 1.0:
        # transformers semantics: over prompt and output, shrink positive logits and grow
        # negative ones so a seen token always loses probability.
        seen = _ids_tensor(request.token_ids, row)
        if seen.numel():
            seen = seen.unique()
            scores = row[seen]
            penalty = params.repetition_penalty
            row[seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        # OpenAI semantics: output tokens only, subtracted from the logits.
        output = _ids_tensor(request.output_token_ids(), row)
        if output.numel():
            counts = torch.bincount(output, minlength=row.shape[0]).to(row.dtype)
            row -= params.frequency_penalty * counts
            row -= params.presence_penalty * (counts > 0).to(row.dtype)


def _mask_stop_tokens(row: torch.Tensor, request: SamplingRow) -> None:
    params = request.params
    # A constrained row's grammar decides when EOS may come (it may be all it allows).
    if (
        params.stop_token_ids
        and request.num_output_tokens < params.min_tokens
        and not params.grammar
    ):
        row[_ids_tensor(params.stop_token_ids, row)] = float("-inf")


def _ids_tensor(ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(list(ids), dtype=torch.long, device=like.device)


def _choose(row: torch.Tensor, request: SamplingRow) -> int:
    params = request.params
    if params.temperature == 0.0:
        return int(torch.argmax(row))
    row = row / params.temperature
    if params.top_k > 0 and params.top_k < row.shape[0]:
        kth_best = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth_best, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    generator = torch.Generator(device=row.device)
    generator.manual_seed(mix_seed(params.seed, request.num_output_tokens))
    # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i,
    # and needs no renormalisation after the filters above zeroed some p_i.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    # A zero draw would turn a filtered-out token's 0 / 0 into NaN, which argmax picks.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return int(torch.argmax(probs / noise))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `top_p`."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p  # the best token always has mass_before 0: kept
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)


def _with_logprobs(
    logits: torch.Tensor, token_ids: list[int], requests: Sequence[SamplingRow]
) -> list[SampledToken]:
    """Logprobs under the raw distribution, for the rows that asked for them (num_logprobs
    > 0: only those reach a client); other rows get logprob 0.0, not computed. A log_softmax
    over every row was a large share of the worker's step at 256 greedy rows of a 49k
    vocabulary. (log_softmax is one fused kernel, measured several times faster for 64 x 32k
    rows than logsumexp's separate max/sub/exp/sum.)"""
    sampled = [SampledToken(token_id, 0.0) for token_id in token_ids]
    wanted = [row for row, request in enumerate(requests) if request.params.num_logprobs > 0]
    if not wanted:
        return sampled
    rows = logits if len(wanted) == len(requests) else logits[wanted]
    logprobs = torch.log_softmax(rows, dim=-1)
    max_top = max(requests[row].params.num_logprobs for row in wanted)
    top = torch.topk(logprobs, min(max_top, logprobs.shape[-1]), dim=-1)
    top_values, top_ids = top.values.tolist(), top.indices.tolist()
    chosen = logprobs.gather(
        1, torch.tensor([token_ids[row] for row in wanted], device=logprobs.device)[:, None]
    )
    for i, (row, value) in enumerate(zip(wanted, chosen[:, 0].tolist(), strict=True)):
        n = requests[row].params.num_logprobs
        sampled[row] = SampledToken(
            token_ids[row], value, tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True))
        )
    return sampled
