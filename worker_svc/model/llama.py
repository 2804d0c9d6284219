"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), and
their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE (sparse MLPs: `moe.py`).

Reads top to bottom: attention, MLP, one decoder layer, the stack, the LM head, and the
loader that maps checkpoint names (Hugging Face spelling) onto the fused parameters.
The batch is flat: every tensor is [num_tokens, ...] over all sequences of the step,
and `AttentionMetadata` says which tokens belong together.

Parallelism: a model is built for one rank (`ParallelConfig`). Tensor parallelism
splits heads, MLP columns and vocabulary rows (`parallel_layers.py`); a pipeline stage
holds only its `layer_range`, the embedding on the first stage, the final norm and LM
head on the last. Layers pass (hidden, residual) on, adding the residual at the start
of the next layer (the vLLM layout), so a stage boundary can cut between any two layers;
the sums are the ones transformers computes, in the same order, so results match it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    StepRotary,
    silu_and_mul,
)
from worker_svc.model.matmul import PreparableLinear
from worker_svc.model.moe import (
    FusedExperts,
    PartialSum,
    SparseMoeBlock,
    checkpoint_name,
    expert_tensor,
)
from worker_svc.model.parallel_layers import (
    FULL,
    Index,
    NoComm,
    RowParallelLinear,
    TPComm,
    VocabParallelEmbedding,
    attention_shard,
    check_tensor_parallel,
    shard_range,
)
from worker_svc.parallel import ParallelConfig


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, parallel: ParallelConfig, comm: TPComm
    ) -> None:
        super().__init__()
        shard = attention_shard(
            config.num_heads, config.num_kv_heads, parallel.tp_size, parallel.tp_rank
        )
        head_dim = config.head_dim
        self.num_heads = shard.num_heads  # this rank's
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_index]
        q_size = shard.num_heads * head_dim
        kv_size = shard.num_kv_heads * head_dim
        kv_start = shard.kv_head_start * head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size,
            {"q": q_size, "k": kv_size, "v": kv_size},
            config.qkv_bias,
            part_row_starts={"q": shard.q_head_start * head_dim, "k": kv_start, "v": kv_start},
        )
        self.o_proj = RowParallelLinear(
            shard.q_head_start * head_dim,
            q_size,
            config.hidden_size,
            config.o_proj_bias,
            parallel.tp_size,
            comm,
        )
        # Per-head norms: the same weights on every rank.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        rotary: StepRotary,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rotary.apply_(q)  # in place: q and k are views of the qkv output
        rotary.apply_(k)
        # Store first: this step's tokens attend to themselves through the cache.
        backend.store_kv(k, v, kv_cache, metadata)
        attn = backend.forward(q, kv_cache, metadata, self.scale, self.sliding_window, k, v)
        return self.o_proj(attn.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelConfig,
        comm: TPComm,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        start, stop = shard_range(
            intermediate_size or config.intermediate_size,
            parallel.tp_size,
            parallel.tp_rank,
            "intermediate_size",
        )
        self.intermediate_size = stop - start  # this rank's
        self.gate_up_proj = MergedLinear(
            config.hidden_size,
            {"gate": self.intermediate_size, "up": self.intermediate_size},
            config.mlp_bias,
            part_row_starts={"gate": start, "up": start},
        )
        self.down_proj = RowParallelLinear(
            start,
            self.intermediate_size,
            config.hidden_size,
            config.mlp_bias,
            parallel.tp_size,
            comm,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def build_mlp(
    config: ModelConfig, layer_index: int, parallel: ParallelConfig, comm: TPComm
) -> nn.Module:
    """Layer `layer_index`'s MLP: dense, or a mixture of experts (with Qwen2-MoE's shared
    expert, a dense MLP whose sum the block completes)."""
    if not config.is_sparse(layer_index):
        return LlamaMLP(config, parallel, comm)
    shared_size = config.moe.shared_expert_intermediate_size
    shared = LlamaMLP(config, parallel, PartialSum(), shared_size) if shared_size else None
    return SparseMoeBlock(config, parallel, comm, shared, layer_index)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, parallel: ParallelConfig, comm: TPComm
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index, parallel, comm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = build_mlp(config, layer_index, parallel, comm)

    def forward(
        self,
        rotary: StepRotary,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous MLP output, residual before it) -> (this MLP's output, its residual).

        Each residual add is fused into the norm after it, in the model dtype as
        transformers adds `residual + hidden`, so bf16 rounds alike; `residual` may be
        added into in place. The first layer gets residual None.
        """
        normed, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(rotary, normed, kv_cache, metadata, backend)
        normed, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(normed), residual


class PPMissingLayer(nn.Identity):
    """Placeholder for a layer another pipeline stage holds: keeps global layer indices
    (and so checkpoint names) valid, holds no weights."""


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelConfig, max_positions: int, parallel: ParallelConfig, comm: TPComm
    ) -> None:
        super().__init__()
        self.layer_range = parallel.layer_range(config.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel.tp_size, parallel.tp_rank, comm
            )
            if parallel.is_first_stage
            else None
        )
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, parallel, comm)
            if i in self.layer_range
            else PPMissingLayer()
            for i in range(config.num_layers)
        )
        self.norm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if parallel.is_last_stage else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`embed_overrides` (rows, embeddings): the first stage's input embeddings of those
        rows replaced (an image's, in a vision-language prompt)."""
        if intermediate is None:
            if self.embed_tokens is None:
                raise ValueError("a later pipeline stage needs the previous stage's activations")
            hidden, residual = self.embed_tokens(input_ids), None
            if embed_overrides is not None:
                rows, embeddings = embed_overrides
                hidden[rows] = embeddings.to(hidden.dtype)
        else:
            hidden, residual = intermediate
        rotary = self.rotary(positions, hidden.dtype)  # once per step, shared by all layers
        for index, kv_cache in zip(self.layer_range, kv_caches, strict=True):
            hidden, residual = self.layers[index](
                rotary, hidden, residual, kv_cache, metadata, backend
            )
        return hidden, residual


# Checkpoint part name -> (fused parameter, part) for the stacked projections.
STACKED_PARTS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
_EMBED = "model.embed_tokens.weight"


def checkpoint_leaf(fused_path: str, part: str) -> str:
    """The checkpoint's name for `part` of the fused module at `fused_path`:
    ("model.layers.0.self_attn.qkv_proj", "k") -> "k_proj" (STACKED_PARTS, inverted)."""
    fused = fused_path.rpartition(".")[2]
    return next(leaf for leaf, (f, p) in STACKED_PARTS.items() if f == fused and p == part)


_LM_HEAD = "lm_head.weight"


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        max_positions: int | None = None,
        parallel: ParallelConfig | None = None,
        comm: TPComm | None = None,
        lm_head: bool = True,
    ) -> None:
        """`lm_head` False: an embedding model's trunk (its last stage pools the final
        hidden states, `final_hidden`; a checkpoint's LM head is not read)."""
        super().__init__()
        parallel = parallel or ParallelConfig()
        check_tensor_parallel(config, parallel.tp_size, parallel.expert_parallel)
        comm = comm or NoComm(parallel.tp_size)
        self.config = config
        self.parallel = parallel
        self.model = LlamaModel(
            config, max_positions or config.max_position_embeddings, parallel, comm
        )
        # Tied checkpoints reuse the embedding as LM head when one stage holds both; no
        # second parameter, so nothing can untie them when the model is moved. A last
        # stage without the embedding gets its own copy of the (same) rows.
        needs_head = (
            lm_head
            and parallel.is_last_stage
            and not (config.tie_word_embeddings and parallel.is_first_stage)
        )
        self.lm_head = (
            VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, parallel.tp_size, parallel.tp_rank, comm
            )
            if needs_head
            else None
        )
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        if lm_head and parallel.is_last_stage and head is not None:
            head.packable = True  # the logits matmul may be packed (matmul.py)

    @property
    def num_local_layers(self) -> int:
        return len(self.model.layer_range)

    @property
    def num_local_kv_heads(self) -> int:
        return attention_shard(
            self.config.num_heads,
            self.config.num_kv_heads,
            self.parallel.tp_size,
            self.parallel.tp_rank,
        ).num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
        embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [num_tokens] (or the previous stage's (hidden, residual))
        -> this stage's (hidden, residual), each [num_tokens, hidden]; one `kv_caches`
        entry per local layer. `embed_overrides`: see LlamaModel.forward."""
        return self.model(
            input_ids, positions, kv_caches, metadata, backend, intermediate, embed_overrides
        )

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Last stage: [num_rows, hidden] x2 -> fp32 logits [num_rows, vocab_size]. The final
        residual add and norm run here, on the sampled rows only (both are per row); the
        sum may be written into `residual`."""
        if self.model.norm is None:
            raise ValueError("only the last pipeline stage computes logits")
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        return head.logits(self.model.norm.add_forward(hidden, residual)[0])

    def final_hidden(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Last stage: the final residual add and norm of rows [num_rows, hidden] x2, what
        an embedding model pools (transformers' `last_hidden_state`)."""
        if self.model.norm is None:
            raise ValueError("only the last pipeline stage holds the final norm")
        return self.model.norm.add_forward(hidden, residual)[0]

    def checkpoint_slice(self, name: str) -> Index | None:
        """Which part of checkpoint tensor `name` this rank loads; None when it loads none
        of it (another stage's layer, a duplicate, a buffer we compute)."""
        name = checkpoint_name(name)
        tied = self.config.tie_word_embeddings
        if name.endswith("rotary_emb.inv_freq") or (name == _LM_HEAD and tied):
            return None
        if name in (_EMBED, _LM_HEAD):
            holder = self._vocab_holders(name)
            return holder[0].checkpoint_slice() if holder else None
        if name == "model.norm.weight":
            return FULL if self.model.norm is not None else None
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            if not index.isdigit() or int(index) not in self.model.layer_range:
                return None
        expert = expert_tensor(name)
        if expert is not None:
            experts_path, index, part = expert
            return self._experts(experts_path, name).checkpoint_slice(index, part)
        module_path, _, param_name = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in STACKED_PARTS:
            fused, part = STACKED_PARTS[leaf]
            return self.get_submodule(f"{parent}.{fused}").checkpoint_slice(part)
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return FULL  # unknown: load_weights names it
        if isinstance(module, RowParallelLinear):
            return module.checkpoint_slice(param_name)
        return FULL

    def _experts(self, path: str, name: str) -> FusedExperts:
        try:
            module = self.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, FusedExperts):
            raise ValueError(
                f"checkpoint tensor {name!r} is an expert's, but this model's "
                f"layer has no experts there (config.json's MoE settings)"
            )
        return module

    def _vocab_holders(self, name: str) -> list[VocabParallelEmbedding]:
        """The modules filled from checkpoint tensor `name` (embedding or LM head rows)."""
        if name == _LM_HEAD:
            return [self.lm_head] if self.lm_head is not None else []
        holders = [self.model.embed_tokens] if self.model.embed_tokens is not None else []
        if self.config.tie_word_embeddings and self.lm_head is not None:
            holders.append(self.lm_head)
        return holders

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs in, each already cut to
        `checkpoint_slice(name)`; returns the parameter names filled.

        Raises if a checkpoint name is unknown or a parameter is left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = checkpoint_name(name)
            if self.checkpoint_slice(name) is None:
                continue
            expert = expert_tensor(name)
            if expert is not None:
                experts_path, index, part = expert
                self._experts(experts_path, name).load_expert(index, part, tensor)
                continue
            if name in (_EMBED, _LM_HEAD):
                for holder in self._vocab_holders(name):
                    holder.load(tensor)
                    loaded.add(_LM_HEAD if holder is self.lm_head else _EMBED)
                continue
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in STACKED_PARTS:
                fused, part = STACKED_PARTS[leaf]
                self.get_submodule(f"{parent}.{fused}").load_part(part, param_name, tensor)
                loaded.add(f"{parent}.{fused}.{param_name}/{part}")
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in this model")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"{name}: expected {tuple(param.shape)}, got {tuple(tensor.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        self._check_all_loaded(params, loaded)
        return loaded

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            module = self.get_submodule(name.rpartition(".")[0])
            if name.endswith(".weight") and _holds_prepared_weight(module):
                continue  # loaded in another form (quantized): see worker_svc/quant
            if isinstance(module, FusedExperts):
                if name.endswith(".w13"):  # once per module: it tracks its own pieces
                    missing += [f"{name.rpartition('.')[0]}.{piece}" for piece in module.missing()]
            elif isinstance(module, MergedLinear):
                missing += [f"{name}/{p}" for p in module.part_sizes if f"{name}/{p}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def _holds_prepared_weight(module: nn.Module) -> bool:
    # While loading, a prepared weight is a quantized one: oneDNN packing comes after.
    return isinstance(module, PreparableLinear) and module.packed_weight is not None
