"""The sparse MLP of mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE.

A block replaces a layer's dense MLP (`config.is_sparse(layer)`); attention, norms and the
stack are the Llama family's (`llama.py`). Per step: router logits (`gate`, replicated on
every rank, through `F.linear` as transformers computes them, so near-ties go the same
way), softmax and top-k (`kernels.moe.route`), the experts over the tokens grouped by
expert (`kernels.moe.grouped_experts`: one sort, one GEMM pair per expert with rows, one
weighted scatter-add; on CUDA the Triton grouped GEMM of `kernels/fused_moe_triton.py`),
Qwen2-MoE's shared expert scaled by its sigmoid gate, then one all-reduce (under expert
parallelism an all-gather: `SparseMoeBlock`).

Tensor parallelism slices every expert as the dense MLP is sliced (each rank the same
columns of each expert's gate|up and rows of its down), so a rank's routed and shared sums
are partial and the block's one all-reduce completes both.

The experts' weights are two 3-D parameters, `w13` [experts, 2 x intermediate, hidden]
(gate rows, then up rows) and `w2` [experts, hidden, intermediate]; the checkpoint's
per-expert tensors (`experts.{e}.gate_proj` / Mixtral's `w1`, `up_proj` / `w3`,
`down_proj` / `w2`) are copied into their slices (`checkpoint_name`, `load_expert`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kernels import cpu_linear, cpu_native
from kernels import moe as moe_kernels
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import silu_and_mul
from worker_svc.model.matmul import PreparedWeight, linear, onednn_weight
from worker_svc.model.parallel_layers import Index, TPComm, shard_range
from worker_svc.parallel import ParallelConfig

# A checkpoint's expert tensor: (prefix up to the block, expert, part, parameter).
_EXPERT_NAME = re.compile(
    r"^(?P<block>.+\.(?:mlp|block_sparse_moe))\.experts\.(?P<expert>\d+)\."
    r"(?P<part>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<param>weight)$"
)
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_ONEDNN_PACK_ROWS = 16  # an expert sees ~tokens x top_k / experts rows


@dataclass(frozen=True)
class ExpertPlacement:
    """Which expert-parallel rank holds each expert: `owner[e]`, a table (not a formula), so
    a rebalancer can move experts. `contiguous` is the default: runs of consecutive experts,
    the first `num_experts % ranks` ranks one more (7 experts on 2 ranks: 0-3 and 4-6)."""

    owner: tuple[int, ...]

    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> ExpertPlacement:
        if num_experts < num_ranks:
            raise ValueError(
                f"expert parallelism over {num_ranks} ranks needs at least as "
                f"many experts; the model has {num_experts}: drop "
                "--enable-expert-parallel (each rank then holds a slice of every "
                "expert)"
            )
        base, extra = divmod(num_experts, num_ranks)
        sizes = [base + (rank < extra) for rank in range(num_ranks)]
        return cls(tuple(rank for rank, size in enumerate(sizes) for _ in range(size)))

    def experts_of(self, rank: int) -> list[int]:
        """The global ids of the experts `rank` holds, ascending."""
        return [e for e, owner in enumerate(self.owner) if owner == rank]


class PartialSum:
    """A TPComm for the pieces inside a sparse block: their row-parallel sums stay partial
    (identity), the block's own all-reduce completes them once."""

    def tp_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def tp_all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        raise RuntimeError("a sparse block's pieces gather nothing")


def checkpoint_name(name: str) -> str:
    """A checkpoint name in this model's spelling: Mixtral's `block_sparse_moe` is `mlp`,
    its experts' `w1` / `w3` / `w2` are `gate_proj` / `up_proj` / `down_proj`."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = _EXPERT_NAME.match(name)
    if match and match["part"] in _MIXTRAL_PARTS:
        start, stop = match.span("part")
        name = name[:start] + _MIXTRAL_PARTS[match["part"]] + name[stop:]
    return name


def expert_tensor(name: str) -> tuple[str, int, str] | None:
    """("model.layers.3.mlp.experts.5.up_proj.weight") -> ("model.layers.3.mlp.experts",
    5, "up_proj"); None for any other tensor (spelled as `checkpoint_name` returns it)."""
    match = _EXPERT_NAME.match(name)
    if match is None:
        return None
    return f"{match['block']}.experts", int(match["expert"]), match["part"]


class FusedExperts(nn.Module):
    """Every expert's SiLU-gated MLP, this rank's slice of each (module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelConfig,
        placement: ExpertPlacement | None = None,
    ) -> None:
        """Tensor-parallel (`placement` None): every expert, this rank's slice of each.
        Expert-parallel: the experts `placement` gives this rank, whole; `local_index` maps
        a global expert id to its index here (the block sends each row with that index)."""
        super().__init__()
        if placement is None:
            start, stop = shard_range(
                intermediate_size, parallel.tp_size, parallel.tp_rank, "moe_intermediate_size"
            )
            local = list(range(num_experts))
        else:
            start, stop = 0, intermediate_size
            local = placement.experts_of(parallel.tp_rank)
        self.num_experts = len(local)  # held here
        self.global_ids = local
        self.local_index = {e: i for i, e in enumerate(local)}  # global id -> index here
        self.num_global_experts = num_experts
        self.intermediate_start = start
        self.intermediate_size = stop - start  # this rank's
        self.w13 = nn.Parameter(
            torch.empty(self.num_experts, 2 * self.intermediate_size, hidden_size),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(self.num_experts, hidden_size, self.intermediate_size), requires_grad=False
        )
        self.loaded: set[tuple[int, str]] = set()
        # Once `pack_experts` has run: per expert (gate|up, down) prepared for oneDNN, or
        # every expert's C panels back to back (gate|up, down, the library).
        self.packed: list[tuple[PreparedWeight, PreparedWeight]] | None = None
        self.native: tuple[torch.Tensor, torch.Tensor, object] | None = None
        self.backend = "torch"  # how pack_experts last prepared them

    def assign(
        self, experts: list[int], weights_of: Callable[[int], tuple[torch.Tensor, ...]]
    ) -> None:
        """Hold `experts` (global ids, ascending) from now on, whole (expert parallelism),
        their (gate, up, down) weights from `weights_of`, packed as before."""
        dtype, device = self.w13.dtype, self.w13.device
        gates_ups, downs = [], []
        for e in experts:
            gate, up, down = weights_of(e)
            gates_ups.append(torch.cat([gate, up]))
            downs.append(down)
        self.global_ids = list(experts)
        self.local_index = {e: i for i, e in enumerate(experts)}
        self.num_experts = len(experts)
        self.w13 = nn.Parameter(
            torch.stack(gates_ups).to(dtype=dtype, device=device), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.stack(downs).to(dtype=dtype, device=device), requires_grad=False
        )
        self.packed, self.native = None, None
        self.pack_experts(self.backend)

    def checkpoint_slice(self, expert: int, part: str) -> Index | None:
        """The part of (global) expert `expert`'s `part` tensor this rank reads."""
        if expert not in self.local_index:
            return None
        cols = slice(self.intermediate_start, self.intermediate_start + self.intermediate_size)
        return (slice(None), cols) if part == "down_proj" else (cols,)

    def load_expert(self, expert: int, part: str, tensor: torch.Tensor) -> None:
        """Copy (global) expert `expert`'s `part`, already cut to `checkpoint_slice`."""
        size = self.intermediate_size
        local = self.local_index[expert]
        target = {
            "gate_proj": self.w13.data[local, :size],
            "up_proj": self.w13.data[local, size:],
            "down_proj": self.w2.data[local],
        }[part]
        if target.shape != tensor.shape:
            raise ValueError(
                f"expert {expert} {part}: expected {tuple(target.shape)}, got {tuple(tensor.shape)}"
            )
        target.copy_(tensor)
        self.loaded.add((expert, part))

    def missing(self) -> list[str]:
        """The (expert, part) pieces no checkpoint tensor filled."""
        return [
            f"experts.{e}.{part}"
            for e in self.global_ids
            for part in ("gate_proj", "up_proj", "down_proj")
            if (e, part) not in self.loaded
        ]

    def pack_experts(self, backend: str) -> None:
        """Each expert's weights into the linear layers' prepared form (`matmul.py`): for
        "native" every expert's panels back to back, run by one C call per step
        (`cpu_linear.moe_f32`); for "onednn" each expert's blocked layout. The 3-D copies
        are freed. Experts kept as GGUF blocks (`worker_svc/quant/gguf.py`) stay so."""
        self.backend = backend
        if self.packed is not None and self.w13.shape[1] == 0:
            return  # already prepared (GGUF blocks)
        if backend == "native":
            lib = cpu_native.library("cpu_linear")
            self.native = (
                torch.cat([cpu_linear.pack_linear_f32(w, lib=lib) for w in self.w13]),
                torch.cat([cpu_linear.pack_linear_f32(w, lib=lib) for w in self.w2]),
                lib,
            )
        elif backend == "onednn":
            self.packed = [
                (
                    onednn_weight(self.w13[e], _ONEDNN_PACK_ROWS),
                    onednn_weight(self.w2[e], _ONEDNN_PACK_ROWS),
                )
                for e in range(self.num_experts)
            ]
        else:
            return
        self.w13 = nn.Parameter(
            torch.empty((self.num_experts, 0, self.w13.shape[2]), dtype=self.w13.dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty((self.num_experts, self.w2.shape[1], 0), dtype=self.w2.dtype),
            requires_grad=False,
        )

    @property
    def packed_nbytes(self) -> int:
        if self.native is not None:
            return sum(t.numel() * t.element_size() for t in self.native[:2])
        return sum(a.nbytes + b.nbytes for a, b in self.packed or ())

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s MLP over its rows (this rank's partial sum under TP)."""
        if self.packed is not None:
            gate_up, down = self.packed[e]
            return linear(silu_and_mul(linear(x, None, None, gate_up)), None, None, down)
        return F.linear(silu_and_mul(F.linear(x, self.w13[e])), self.w2[e])

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weight * expert(x) over the chosen experts held here, by local index (ids
        outside 0..num_experts-1 add nothing)."""
        if hidden.is_cuda:  # one grouped GEMM launch per projection, no host sync
            from kernels.fused_moe_triton import fused_experts_triton

            return fused_experts_triton(hidden, self.w13, self.w2, topk_weights, topk_ids)
        if self.native is not None:
            w13, w2, lib = self.native
            return cpu_linear.moe_f32(
                hidden,
                topk_weights,
                topk_ids,
                w13,
                w2,
                self.num_experts,
                self.intermediate_size,
                lib=lib,
            )
        return moe_kernels.grouped_experts(
            hidden, topk_weights, topk_ids, self.num_experts, self.expert
        )


class SparseMoeBlock(nn.Module):
    """Router, experts, and Qwen2-MoE's gated shared expert (`shared_expert`, a dense MLP
    whose row-parallel sum stays partial: built with `PartialSum`), ending in one
    all-reduce.

    Under expert parallelism (`parallel.expert_parallel`, tp > 1) each rank holds whole
    experts (`placement`) and every rank has every token (attention is tensor-parallel):
    rank r routes only its share of the step's tokens (rows S*r .. S*(r+1), S = ceil(T/N)),
    sends each (token, slot)'s row to the rank holding its expert (all-to-all), runs its
    experts over what it received, sends the outputs back (all-to-all), and sums its
    tokens' weighted rows experts ascending, as the tensor-parallel path does. An all-gather then
    assembles
    the token shares; with a shared expert, whose sums are partial (tensor-parallel), the
    block's all-reduce assembles both at once (each rank's rows, zeros elsewhere).
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        comm: TPComm,
        shared_expert: nn.Module | None = None,
        layer_index: int = 0,
    ) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("a sparse block needs the model's MoE settings")
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.fp32_routing_weights = moe.fp32_routing_weights
        self.comm = comm
        self.tp_size, self.tp_rank = parallel.tp_size, parallel.tp_rank
        self.placement = (
            ExpertPlacement.contiguous(moe.num_experts, parallel.tp_size)
            if parallel.expert_parallel and parallel.tp_size > 1
            else None
        )
        # Replicated: every rank routes every token the same way.
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = FusedExperts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, parallel, self.placement
        )
        if self.placement is not None:
            self._set_owner_tables()
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False) if shared_expert is not None else None
        )
        # Tokens routed to each expert since load (a token counts once per chosen expert):
        # what an expert-load balancer reads. Counted by the ranks that route distinct
        # tokens (every rank under EP, its share; rank 0 alone under TP), so a stage's sum
        # over its ranks is the layer's load. Kept on the model's device, read when asked.
        self.layer_index = layer_index
        self.counts_load = self.placement is not None or parallel.tp_rank == 0
        self.expert_tokens: torch.Tensor | None = None
        self._window_start: torch.Tensor | None = None  # expert_tokens at the last rebalance

    def _set_owner_tables(self) -> None:
        """Per global expert: the rank holding it, and its index there."""
        owner = self.placement.owner
        self.owner = torch.tensor(owner, dtype=torch.int64, device="cpu")
        self.owner_index = torch.tensor(
            [owner[:e].count(owner[e]) for e in range(len(owner))], dtype=torch.int64, device="cpu"
        )

    def set_placement(
        self, placement: ExpertPlacement, weights_of: Callable[[int], tuple[torch.Tensor, ...]]
    ) -> None:
        """Expert parallelism: hold `placement`'s experts for this rank from now on
        (`worker_svc/model/expert_balance.py` decides; every rank of the stage at once)."""
        self.placement = placement
        self._set_owner_tables()
        self.experts.assign(placement.experts_of(self.tp_rank), weights_of)

    def take_window_tokens(self) -> torch.Tensor:
        """Tokens routed to each expert since the last call (on the model's device)."""
        num_experts = self.gate.weight.shape[0]
        if self.expert_tokens is None:
            return torch.zeros(num_experts, dtype=torch.int64, device=self.gate.weight.device)
        start = self._window_start if self._window_start is not None else 0
        window = self.expert_tokens - start
        self._window_start = self.expert_tokens.clone()
        return window

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, hidden] -> (topk_weights, topk_ids), as transformers routes them; the
        choices are added to `expert_tokens`."""
        logits = F.linear(hidden, self.gate.weight)
        weights_dtype = torch.float32 if self.fp32_routing_weights else logits.dtype
        weights, ids = moe_kernels.route(logits, self.top_k, self.renormalize, weights_dtype)
        if self.counts_load:  # index_add_, not bincount: no host sync (CUDA graphs replay it)
            if self.expert_tokens is None:
                self.expert_tokens = torch.zeros(
                    self.gate.weight.shape[0], dtype=torch.int64, device=ids.device
                )
            flat = ids.reshape(-1)
            self.expert_tokens.index_add_(0, flat, torch.ones_like(flat))
        return weights, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.placement is not None and self.shared_expert is None:
            # Each rank's share assembled by an all-gather: half the all-reduce's bytes.
            share = self._expert_parallel(hidden)
            return self.comm.tp_all_gather(share, dim=0)[: hidden.shape[0]]
        if self.placement is not None:
            out = torch.zeros_like(hidden)
            share = self._expert_parallel(hidden)
            lo = min(share.shape[0] * self.tp_rank, hidden.shape[0])
            out[lo : lo + share.shape[0]] = share[: hidden.shape[0] - lo]
        else:
            topk_weights, topk_ids = self.route(hidden)
            out = self.experts(hidden, topk_weights, topk_ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            scale = torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight))
            out = out + scale * self.shared_expert(hidden)
        return out if self.tp_size == 1 else self.comm.tp_all_reduce(out)

    def _expert_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's share of the tokens (rows share * rank .. share * (rank + 1), share =
        ceil(tokens / ranks)) through their experts wherever they are (class docstring):
        [share, hidden], rows past the last token zero, so every rank's has one shape."""
        num_tokens = hidden.shape[0]
        share = -(-num_tokens // self.tp_size)
        lo = min(share * self.tp_rank, num_tokens)
        hi = min(lo + share, num_tokens)
        x = hidden[lo:hi]
        topk_weights, topk_ids = self.route(x)
        pair_ids = topk_ids.t().reshape(-1)  # pair p = k * tokens + t, slot-major
        destination = self.owner.to(pair_ids.device)[pair_ids]
        send_order = torch.sort(destination, stable=True).indices
        send_counts = torch.bincount(destination, minlength=self.tp_size).tolist()
        rows = x.index_select(0, send_order % x.shape[0])
        local_ids = self.owner_index.to(pair_ids.device)[pair_ids[send_order]]
        received, recv_counts = self.comm.tp_all_to_all(rows, send_counts)
        arrived_ids, _ = self.comm.tp_all_to_all(local_ids, send_counts, recv_counts)
        arrived_ids = arrived_ids.unsqueeze(1)  # each row: one slot, its expert's index here
        outputs = self.experts(
            received, torch.ones_like(arrived_ids, dtype=hidden.dtype), arrived_ids
        )
        back, _ = self.comm.tp_all_to_all(outputs, recv_counts, send_counts)
        by_pair = torch.empty_like(back)
        by_pair[send_order] = back
        order, _, offsets = moe_kernels.expert_order(topk_ids, len(self.placement.owner))
        order = order[: offsets[-1]]
        out = hidden.new_zeros((share, hidden.shape[1]))
        moe_kernels.weighted_sum(
            by_pair.index_select(0, order), order, topk_weights, out[: hi - lo]
        )
        return out


def expert_load(model: nn.Module) -> dict[int, list[int]]:
    """Tokens routed to each expert since load, per sparse layer this rank holds and counts
    (`SparseMoeBlock.expert_tokens`): {layer index: [tokens of expert 0, 1, ...]}."""
    return {
        block.layer_index: block.expert_tokens.tolist()
        for block in model.modules()
        if isinstance(block, SparseMoeBlock) and block.expert_tokens is not None
    }
