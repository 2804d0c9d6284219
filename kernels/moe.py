"""Mixture-of-experts on a flat batch: routing, grouping tokens by expert, the experts'
SiLU-gated MLPs, and the weighted combine.

Layouts (every implementation here and in `kernels/fused_moe_triton.py` shares them):
hidden `[num_tokens, hidden]`; w13 `[num_experts, 2 * intermediate, hidden]` (each expert's
gate rows, then its up rows, as a fused gate|up linear weight); w2 `[num_experts, hidden,
intermediate]`; topk_weights `[num_tokens, top_k]` (any float dtype); topk_ids `[num_tokens,
top_k]` (int). An id outside `0..num_experts-1` (-1: an expert another rank holds under
expert parallelism) contributes nothing. The result is, per token,
`sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))` with `e = topk_ids[t, k]`.

The CPU path (`grouped_experts`) is what vLLM and SGLang do on any device: one stable sort
of the step's (token, slot) pairs by expert, one GEMM pair per expert that has rows, and one
`index_add_` of the weighted rows in that sorted order. Each expert sees its rows in the
order transformers' per-expert loop gathers them and a token's rows are added experts
ascending, as there: in fp32 the results are equal bit for bit. In bf16/fp16 torch's
`index_add_` does not round after every row of a token the way transformers' one call per
expert does, so the sums differ by about one unit in the last place. `per_expert_loop` is
that loop as transformers 5 writes it, kept as the baseline `bench.moe` measures against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

# (expert index, its rows of hidden [rows, hidden]) -> its MLP's output [rows, hidden].
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [num_tokens, num_experts] -> (topk_weights, topk_ids), as transformers'
    Mixtral / Qwen2-MoE / Qwen3-MoE routers compute them: softmax in fp32, `torch.topk` (so
    between equal probabilities the same expert wins as there: on CPU the lower index
    first), renormalised over the chosen k when asked, cast to `weights_dtype` (Qwen: the
    logits' dtype; Mixtral keeps fp32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def expert_order(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, slot) pairs grouped by expert: (pairs as slot-major indices p = k *
    num_tokens + t, in expert order, stable, so within an expert they run slot by slot,
    tokens ascending, as transformers' `torch.where` over its mask lists them; the count of
    pairs per expert; the start of each expert's run as num_experts + 1 offsets). Ids
    outside 0..num_experts-1 sort to the end, past the last offset."""
    flat = topk_ids.t().reshape(-1).to(torch.int64)
    local = (flat >= 0) & (flat < num_experts)
    keys = torch.where(local, flat, num_experts)
    order = torch.sort(keys, stable=True).indices
    counts = torch.bincount(keys, minlength=num_experts + 1)[:num_experts]
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    return order, counts, offsets


def grouped_experts(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: ExpertFn,
) -> torch.Tensor:
    """sum_k weight * expert_e(x) over each token's chosen experts: one sort, one call of
    `expert` per expert with rows, one weighted `index_add_` (module docstring)."""
    num_tokens = topk_ids.shape[0]
    out = torch.zeros_like(hidden)
    order, _, offsets = expert_order(topk_ids, num_experts)
    if offsets[-1] == 0:
        return out
    order = order[: offsets[-1]]
    rows = hidden.index_select(0, order % num_tokens)
    results = torch.empty_like(rows)
    for e in range(num_experts):
        start, stop = offsets[e], offsets[e + 1]
        if stop > start:
            results[start:stop] = expert(e, rows[start:stop])
    return weighted_sum(results, order, topk_weights, out)


def weighted_sum(
    results: torch.Tensor, order: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out[t] += weight * row for each expert output row `results[i]` of pair `order[i]`
    (slot-major, as `expert_order` gives them), in that order, in one `index_add_`."""
    weights = topk_weights.t().reshape(-1).index_select(0, order).unsqueeze(1)
    out.index_add_(0, order % out.shape[0], (results * weights).to(out.dtype))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate|up [rows, 2 * intermediate] -> silu(gate) * up (torch ops: the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_mul,
) -> torch.Tensor:
    """The torch path and the reference of the Triton kernel (same signature): the experts
    of plain 3-D weights through `grouped_experts` and `F.linear`."""

    def expert(e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(act(F.linear(x, w13[e])), w2[e])

    return grouped_experts(hidden, topk_weights, topk_ids, w13.shape[0], expert)


def per_expert_loop(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """transformers 5's experts loop (`Qwen3MoeExperts.forward`): per expert a one-hot mask,
    a `where`, a gather, the MLP, and an `index_add_`. The baseline of `bench.moe`."""
    num_experts = w13.shape[0]
    out = torch.zeros_like(hidden)
    mask = F.one_hot(topk_ids.to(torch.int64), num_classes=num_experts + 1).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for index in hit:
        e = int(index[0])
        if e == num_experts:
            continue
        slot, token = torch.where(mask[e])
        gate, up = F.linear(hidden[token], w13[e]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, w2[e]) * topk_weights[token, slot, None]
        out.index_add_(0, token, rows.to(out.dtype))
    return out
