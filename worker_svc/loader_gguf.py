"""A GGUF file (llama.cpp's format) as a `ModelSource` of worker_svc/loader.py: the config
from its metadata, its tensor names as Hugging Face's, its quantized tensors dequantized as
they are read (or handed over as raw blocks, worker_svc/quant/gguf.py), each rank cutting
its own slice. Imported only when a .gguf model is opened."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from worker_svc.loader import ARCHITECTURE_BY_MODEL_TYPE, BlockSelector, ModelSource, WeightSelector
from worker_svc.model.config import ModelConfig, MoeConfig, RopeConfig

# GGUF architecture -> model_type; llama.cpp also files Mistral, and Mixtral (a "llama"
# with `llama.expert_count`), under "llama".
_GGUF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
}
# llama.cpp per-layer tensor name -> Hugging Face name under model.layers.N.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# A layer's experts in one 3-D tensor [experts, out, in] -> each expert's projection.
_GGUF_EXPERT_NAMES = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    """llama.cpp tensor name -> Hugging Face name; None for tensors we do not load."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.N.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def gguf_expert_names(name: str, num_experts: int) -> list[str] | None:
    """`blk.N.ffn_up_exps.weight` -> the Hugging Face names of its experts' slices, in order
    (`model.layers.N.mlp.experts.E.up_proj.weight`); None for any other tensor."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_EXPERT_NAMES:
        return None
    return [
        f"model.layers.{parts[1]}.mlp.experts.{e}.{_GGUF_EXPERT_NAMES[parts[2]]}.weight"
        for e in range(num_experts)
    ]


def reverse_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (its rotary pairs adjacent dims, HF pairs
    halves), as transformers' `_reverse_permute_weights` does. Works for biases too."""
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(reader, arch: str, tensor_names: set[str]) -> ModelConfig:
    def meta(key: str, default=None):
        return _gguf_value(reader, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_layers = meta("block_count")
    # Not every converter writes vocab_size; the embedding's row count is always there.
    vocab_size = meta("vocab_size") or next(
        int(t.shape[1]) for t in reader.tensors if t.name == "token_embd.weight"
    )
    rope_divisors = None
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1 scaling, stored per frequency
        rope_freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        rope_divisors = tuple(float(x) for x in rope_freqs.data.reshape(-1))
    scaling_type = meta("rope.scaling.type", "none")
    rope = RopeConfig(
        theta=float(meta("rope.freq_base", 10000.0)),
        rope_type="linear" if scaling_type == "linear" else "default",
        factor=float(meta("rope.scaling.factor", 1.0)) if scaling_type == "linear" else 1.0,
        freq_divisors=rope_divisors,
    )
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    model_type = _GGUF_MODEL_TYPES[arch]
    if arch == "llama" and meta("expert_count", 0):
        model_type = "mixtral"
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=meta("attention.head_count_kv", num_heads),
        head_dim=meta("attention.key_length", hidden_size // num_heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=meta("context_length", 2048),
        rope=rope,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        moe=_gguf_moe(meta, arch, num_layers, tensor_names),
    )


def _gguf_moe(meta, arch: str, num_layers: int, tensor_names: set[str]) -> MoeConfig | None:
    """The sparse MLP settings from llama.cpp's `expert_*` keys; a layer is sparse where it
    has a router (`ffn_gate_inp`). Renormalised top-k: `expert_weights_norm` where written,
    else as llama.cpp runs each architecture (Mixtral and Qwen3-MoE yes, Qwen2-MoE no)."""
    num_experts = meta("expert_count", 0)
    if not num_experts:
        return None
    mixtral = arch == "llama"
    return MoeConfig(
        num_experts=int(num_experts),
        top_k=int(meta("expert_used_count")),
        intermediate_size=int(
            meta("feed_forward_length") if mixtral else meta("expert_feed_forward_length")
        ),
        renormalize=bool(meta("expert_weights_norm", arch != "qwen2moe")),
        shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0)),
        sparse_layers=tuple(
            f"blk.{i}.ffn_gate_inp.weight" in tensor_names for i in range(num_layers)
        ),
        fp32_routing_weights=mixtral,
    )


def open_gguf(path: Path) -> ModelSource:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _gguf_value(reader, "general.architecture")
    if arch not in _GGUF_MODEL_TYPES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(_GGUF_MODEL_TYPES)}"
        )
    config = _gguf_config(reader, arch, {t.name for t in reader.tensors})
    eos_ids = [_gguf_value(reader, "tokenizer.ggml.eos_token_id")]
    # End-of-turn (e.g. <|eot_id|>) also ends generation in llama.cpp.
    eos_ids.append(_gguf_value(reader, "tokenizer.ggml.eot_token_id"))
    tensor_types = {
        hf_name: t.tensor_type.name
        for t in reader.tensors
        if (hf_name := gguf_to_hf_name(t.name)) is not None
    }
    num_experts = config.moe.num_experts if config.moe is not None else 0
    tensor_types |= {
        name: t.tensor_type.name
        for t in reader.tensors
        for name in gguf_expert_names(t.name, num_experts) or ()
    }
    return ModelSource(
        config=config,
        name=path.stem,
        architecture=ARCHITECTURE_BY_MODEL_TYPE[config.model_type],
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
        weights=lambda select: _gguf_weights(
            reader, config, select, permuted_rotary=arch == "llama"
        ),
        gguf_tensor_types=tensor_types,
        gguf_blocks=lambda select: _gguf_blocks(
            reader, config, select, permuted_rotary=arch == "llama"
        ),
        stored_dtype=_gguf_stored_dtype(tensor_types),
    )


def _gguf_stored_dtype(tensor_types: dict[str, str]) -> torch.dtype | None:
    """The float type of the linear layers (the bulk of the weights and of the compute);
    None when they are quantized."""
    linear = {t for name, t in tensor_types.items() if name.endswith("_proj.weight")}
    if linear == {"F32"}:
        return torch.float32
    if linear <= {"BF16", "F32"} and "BF16" in linear:
        return torch.bfloat16
    if linear <= {"F16", "F32"} and "F16" in linear:
        return torch.float16
    return None


def _gguf_weights(
    reader, config: ModelConfig, select: WeightSelector, *, permuted_rotary: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of other stages are skipped undecoded. A selected one is dequantized whole,
    then sliced: simple, and the full copy lives only until the slice is taken. (Quant
    blocks run along rows, so row slices could later be cut while still quantized.)"""
    from gguf.quants import dequantize

    num_experts = config.moe.num_experts if config.moe is not None else 0
    for tensor in reader.tensors:
        experts = gguf_expert_names(tensor.name, num_experts)
        if experts is not None:  # dequantized whole, then cut per expert
            yield from _gguf_expert_weights(tensor, experts, select)
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue  # e.g. rope_freqs, already folded into the config
        index = select(hf_name)
        if index is None:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        weight = weight.reshape(shape)
        if permuted_rotary and ".self_attn.q_proj." in hf_name:
            weight = reverse_rotary_permutation(weight, config.num_heads)
        elif permuted_rotary and ".self_attn.k_proj." in hf_name:
            weight = reverse_rotary_permutation(weight, config.num_kv_heads)
        yield hf_name, weight[index]


def _gguf_expert_weights(
    tensor, names: list[str], select: WeightSelector
) -> Iterator[tuple[str, torch.Tensor]]:
    """One 3-D expert tensor's experts this rank selects, each cut to its slice (the
    experts stay dequantized: `--gguf-keep-quantized` keeps the dense layers' blocks only)."""
    from gguf.quants import dequantize

    wanted = [
        (e, name, index) for e, name in enumerate(names) if (index := select(name)) is not None
    ]
    if not wanted:
        return
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weights = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).reshape(shape)
    for e, name, index in wanted:
        yield name, weights[e][index].clone()


def _gguf_blocks(
    reader, config: ModelConfig, select: BlockSelector, *, permuted_rotary: bool
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """The selected tensors' raw blocks, uint8 [rows, bytes per row], q/k rows put back in
    Hugging Face order (a row holds whole blocks, so rows permute like the dequantized
    weight's) and then cut to `select`'s slice."""
    import numpy as np

    num_experts = config.moe.num_experts if config.moe is not None else 0
    for tensor in reader.tensors:
        experts = gguf_expert_names(tensor.name, num_experts)
        if experts is not None:  # [experts, rows, bytes per row]: each expert's rows
            wanted = [
                (e, name, index)
                for e, name in enumerate(experts)
                if (index := select(name, tensor.tensor_type.name)) is not None
            ]
            if wanted:
                stacked = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
                stacked = stacked.reshape(num_experts, -1, stacked.shape[-1])
                for e, name, index in wanted:
                    yield name, tensor.tensor_type.name, stacked[e][index].clone()
            continue
        hf_name = gguf_to_hf_name(tensor.name)
        type_name = tensor.tensor_type.name
        index = None if hf_name is None else select(hf_name, type_name)
        if index is None:
            continue
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        if permuted_rotary and ".self_attn.q_proj." in hf_name:
            blocks = reverse_rotary_permutation(blocks, config.num_heads)
        elif permuted_rotary and ".self_attn.k_proj." in hf_name:
            blocks = reverse_rotary_permutation(blocks, config.num_kv_heads)
        yield hf_name, type_name, blocks[index].clone()  # not a view of the whole tensor
