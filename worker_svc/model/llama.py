"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

Reads top to bottom: attention, MLP, one decoder layer, the stack, the LM head, and the
loader that maps checkpoint names (Hugging Face spelling) onto the fused parameters.
The batch is flat: every tensor is [num_tokens, ...] over all sequences of the step,
and `AttentionMetadata` says which tokens belong together.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.model.config import ModelConfig
from worker_svc.model.layers import (
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    silu_and_mul,
)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_windows[layer_index]
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, config.qkv_bias
        )
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
        kv_cache: torch.Tensor, metadata: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rotary)
        # Store first: this step's tokens attend to themselves through the cache.
        backend.store_kv(k, v, kv_cache, metadata)
        attn = backend.forward(q, kv_cache, metadata, self.scale, self.sliding_window)
        return self.o_proj(attn.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size,
            {"gate": config.intermediate_size, "up": config.intermediate_size},
            config.mlp_bias,
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.intermediate_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, rotary: tuple[torch.Tensor, torch.Tensor], hidden: torch.Tensor,
        kv_cache: torch.Tensor, metadata: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        # Unfused residual adds in the model dtype, as transformers does, so bf16 rounds alike.
        residual = hidden
        hidden = self.self_attn(rotary, self.input_layernorm(hidden), kv_cache, metadata, backend)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary = self.rotary(positions, hidden.dtype)  # once per step, shared by all layers
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rotary, hidden, kv_cache, metadata, backend)
        return self.norm(hidden)


# Checkpoint part name -> (fused parameter, part) for the stacked projections.
_STACKED_PARTS = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        # Tied checkpoints reuse the embedding as LM head; no second parameter, so nothing
        # can untie them when the model is moved or materialised.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata, backend: AttentionBackend,
    ) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions, kv_caches, metadata, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab_size]."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        return F.linear(hidden, head.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (Hugging Face name, tensor) pairs in; returns the parameter names filled.

        Raises if a checkpoint name is unknown or a parameter is left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved the rotary buffer; we compute it
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still carry a copy
            module_path, _, param_name = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            if leaf in _STACKED_PARTS:
                fused, part = _STACKED_PARTS[leaf]
                fused_name = f"{parent}.{fused}.{param_name}"
                module = self.get_submodule(f"{parent}.{fused}")
                module.load_part(part, param_name, tensor)
                loaded.add(f"{fused_name}/{part}")
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
            if isinstance(module, MergedLinear):
                missing += [f"{name}/{p}" for p in module.part_sizes if f"{name}/{p}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
