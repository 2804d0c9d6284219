"""The model shape the decoder needs, parsed once from a HF `config.json` dict.

Both spellings of rotary settings are accepted: transformers 4 (`rope_theta` +
`rope_scaling`) and transformers 5 (`rope_parameters` holding `rope_theta`, `rope_type`
and the scaling fields). GGUF metadata is mapped onto the same dataclasses in
`worker_svc/loader.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type -> architecture family handled by `worker_svc/model/llama.py` (the MoE ones
# with the sparse MLP blocks of `worker_svc/model/moe.py`).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    theta: float = _DEFAULT_ROPE_THETA
    rope_type: str = "default"
    # "linear" and "llama3": divide frequencies by `factor`.
    factor: float = 1.0
    # "llama3" only: wavelength band (in tokens of the original context) that is smoothed.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # llama.cpp files store llama3 scaling as one divisor per frequency (`rope_freqs`);
    # when set, it replaces the formula above.
    freq_divisors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"rope theta and factor must be positive, got {self}")


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model (worker_svc/model/moe.py)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; Qwen's norm_topk_prob)
    # Qwen2-MoE: a dense expert every token goes through, scaled by sigmoid(a linear gate).
    shared_expert_intermediate_size: int = 0
    # Per layer: sparse (True) or a dense MLP of the model's intermediate_size.
    sparse_layers: tuple[bool, ...] = ()
    # Mixtral keeps the routing weights in fp32 (the weighted rows then round once, to the
    # model dtype); Qwen casts them to the model dtype first.
    fp32_routing_weights: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"experts per token ({self.top_k}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.intermediate_size <= 0:
            raise ValueError(
                f"the experts' intermediate size must be positive, got {self.intermediate_size}"
            )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # Qwen3: RMSNorm over each head's q and k before rotary.
    qk_norm: bool = False
    # Per layer: attend to at most this many most recent tokens (None = full context).
    sliding_windows: tuple[int | None, ...] = ()
    moe: MoeConfig | None = None  # mixture-of-experts models only

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"rotary needs an even head_dim, got {self.head_dim}")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows needs one entry per layer")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ValueError("moe.sparse_layers needs one entry per layer")

    def is_sparse(self, layer_index: int) -> bool:
        """Whether layer `layer_index`'s MLP is a mixture of experts."""
        return self.moe is not None and self.moe.sparse_layers[layer_index]


def parse_rope(hf_config: dict[str, Any]) -> RopeConfig:
    """Rotary settings from either the transformers 4 or the transformers 5 spelling."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf_config.get("rope_theta", _DEFAULT_ROPE_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    max_positions = hf_config.get("max_position_embeddings", 8192)
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", max_positions)
        ),
    )


def _sliding_windows(hf_config: dict[str, Any], model_type: str, num_layers: int):
    window = hf_config.get("sliding_window")
    if model_type in ("mistral", "mixtral"):
        return (window,) * num_layers
    if model_type not in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") or not hf_config.get(
        "use_sliding_window"
    ):
        return (None,) * num_layers
    layer_types = hf_config.get("layer_types")
    if layer_types is None:  # transformers 4: the top layers from max_window_layers slide
        first_sliding = hf_config.get("max_window_layers", num_layers)
        layer_types = [
            "sliding_attention" if i >= first_sliding else "full_attention"
            for i in range(num_layers)
        ]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def parse_hf_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from the dict in a Hugging Face `config.json`."""
    model_type = hf_config.get("model_type", "")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"only SiLU MLPs are supported, got {hf_config['hidden_act']!r}")
    num_heads = hf_config["num_attention_heads"]
    num_layers = hf_config["num_hidden_layers"]
    attention_bias = bool(hf_config.get("attention_bias", False))
    is_qwen2 = model_type == "qwen2"
    qkv_bias = attention_bias
    if is_qwen2:
        qkv_bias = True
    elif model_type == "qwen2_moe":  # its own spelling, on by default
        qkv_bias = bool(hf_config.get("qkv_bias", True))
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config["vocab_size"],
        hidden_size=hf_config["hidden_size"],
        intermediate_size=hf_config["intermediate_size"],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
        head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=hf_config.get("max_position_embeddings", 2048),
        rope=parse_rope(hf_config),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        # Qwen2 (and Qwen2-MoE) have q/k/v biases and never an o_proj bias; the others
        # follow `attention_bias` for all four projections.
        qkv_bias=qkv_bias,
        o_proj_bias=False if model_type in ("qwen2", "qwen2_moe") else attention_bias,
        mlp_bias=bool(hf_config.get("mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        sliding_windows=_sliding_windows(hf_config, model_type, num_layers),
        moe=parse_moe(hf_config, model_type, num_layers),
    )


def parse_moe(hf_config: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig | None:
    """The sparse MLP settings of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json, None for a
    dense model. Qwen's layer `i` is sparse unless listed in `mlp_only_layers`, and only
    where `(i + 1) % decoder_sparse_step == 0` (transformers' rule); Mixtral's all are."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    # The hub's files say num_experts (Qwen) / num_local_experts (Mixtral); transformers 5
    # writes num_local_experts for both.
    num_experts = hf_config.get("num_local_experts", hf_config.get("num_experts"))
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=num_experts,
            top_k=hf_config.get("num_experts_per_tok", 2),
            intermediate_size=hf_config["intermediate_size"],
            renormalize=True,
            sparse_layers=(True,) * num_layers,
            fp32_routing_weights=True,
        )
    step = hf_config.get("decoder_sparse_step", 1) or 1
    dense = set(hf_config.get("mlp_only_layers") or ())
    return MoeConfig(
        num_experts=num_experts,
        top_k=hf_config["num_experts_per_tok"],
        intermediate_size=hf_config["moe_intermediate_size"],
        renormalize=bool(hf_config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            hf_config.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        ),
        sparse_layers=tuple(
            i not in dense and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ),
    )
