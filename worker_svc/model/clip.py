"""CLIP: the text and vision towers with their projections, as transformers' `CLIPModel`.

Both towers are pre-LN transformer encoders (LayerNorm, attention, residual; LayerNorm,
MLP, residual) with biases everywhere but in the projections and the patch embedding.
The text tower is causal and pools the final-layer-normed state at the end-of-text
token; the vision tower is bidirectional over [CLS, patches], layer-norms the embeddings
(`pre_layrnorm`, transformers' spelling) and pools the CLS state through `post_layernorm`.
Outputs are unnormalized, as `get_text_features` / `get_image_features`; normalize them
for cosine similarity.

Module names inside a tower are transformers' with `embeddings.` and `encoder.` dropped
(`text_model.encoder.layers.0.mlp.fc1.weight` is `text.layers.0.mlp.fc1.weight`), so
`checkpoint_name_to_parameter` is a prefix rewrite.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,  # OpenAI CLIP's
    "gelu": F.gelu,  # exact (erf) GELU, as transformers' "gelu"
}
# transformers' defaults (CLIPTextConfig / CLIPVisionConfig / CLIPConfig) for missing keys.
DEFAULT_PROJECTION_DIM = 512
# The text tower's legacy end-of-text id: configs written before transformers PR #24773 say
# 2, and transformers then pools at the largest token id (CLIP's end-of-text is the last id).
LEGACY_EOS_TOKEN_ID = 2


def _from_dict(cls: type, values: dict[str, Any]) -> Any:
    """`cls` from the keys of `values` it has fields for; the rest keep their defaults."""
    return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


def _check_encoder(name: str, hidden_size: int, num_heads: int, hidden_act: str) -> None:
    if hidden_size % num_heads:
        raise ValueError(
            f"{name}: hidden_size {hidden_size} is not a multiple of "
            f"num_attention_heads {num_heads}"
        )
    if hidden_act not in ACTIVATIONS:
        raise ValueError(
            f"{name}: hidden_act {hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}"
        )


@dataclass(frozen=True)
class ClipTextConfig:
    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77  # the most tokens one text may have
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407  # pooling position; LEGACY_EOS_TOKEN_ID means "the largest id"

    def __post_init__(self) -> None:
        _check_encoder("text_config", self.hidden_size, self.num_attention_heads, self.hidden_act)
        if not isinstance(self.eos_token_id, int):
            raise ValueError(
                f"text_config: eos_token_id must be one int, got {self.eos_token_id!r}"
            )


@dataclass(frozen=True)
class ClipVisionConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224  # pixels, square
    patch_size: int = 32  # pixels, square
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _check_encoder("vision_config", self.hidden_size, self.num_attention_heads, self.hidden_act)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision_config: image_size {self.image_size} is not a multiple "
                f"of patch_size {self.patch_size}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClipVisionConfig:
        values = dict(values)
        for key in ("image_size", "patch_size"):
            if isinstance(values.get(key), (list, tuple)):
                if len(set(values[key])) != 1:
                    raise ValueError(
                        f"vision_config: only square {key} is supported, got {values[key]}"
                    )
                values[key] = values[key][0]
        return _from_dict(cls, values)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


@dataclass(frozen=True)
class ClipConfig:
    """Which parts exist: a CLIPModel has both towers and `projection_dim`; LLaVA's vision
    tower is `ClipConfig(text=None, vision=..., projection_dim=None)` (no projection)."""

    text: ClipTextConfig | None
    vision: ClipVisionConfig | None
    projection_dim: int | None = DEFAULT_PROJECTION_DIM

    def __post_init__(self) -> None:
        if self.text is None and self.vision is None:
            raise ValueError("a CLIP model needs a text tower, a vision tower or both")
        if self.text is not None and self.projection_dim is None:
            raise ValueError("the text tower needs projection_dim (its output is projected)")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ClipConfig:
        """From a CLIPModel `config.json`. As transformers, `text_config_dict` /
        `vision_config_dict` (older checkpoints) override `text_config` / `vision_config`."""
        text = {**(config.get("text_config") or {}), **(config.get("text_config_dict") or {})}
        vision = {**(config.get("vision_config") or {}), **(config.get("vision_config_dict") or {})}
        return cls(
            text=_from_dict(ClipTextConfig, text),
            vision=ClipVisionConfig.from_dict(vision),
            projection_dim=config.get("projection_dim", DEFAULT_PROJECTION_DIM),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ClipConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def is_clip_folder(path: str | Path) -> bool:
    """Whether `path` holds a transformers CLIPModel (by its config.json)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text())
    return "CLIPModel" in (config.get("architectures") or []) or config.get("model_type") == "clip"


class ClipAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size)
        self.k_proj = nn.Linear(hidden_size, hidden_size)
        self.v_proj = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, is_causal: bool) -> torch.Tensor:
        batch, num_tokens, hidden = x.shape
        shape = (batch, num_tokens, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=self.head_dim**-0.5
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, num_tokens, hidden))


class ClipMlp(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.activation = ACTIVATIONS[hidden_act]
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: ClipTextConfig | ClipVisionConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.layer_norm1 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(hidden, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.mlp = ClipMlp(hidden, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, is_causal: bool) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), is_causal)
        return x + self.mlp(self.layer_norm2(x))


def _projection(hidden_size: int, projection_dim: int | None) -> nn.Linear | None:
    return None if projection_dim is None else nn.Linear(hidden_size, projection_dim, bias=False)


class ClipTextTower(nn.Module):
    """Token ids -> projected embedding at the end-of-text token, [N, projection_dim]."""

    def __init__(self, config: ClipTextConfig, projection_dim: int) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(
            ClipEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.projection = nn.Linear(config.hidden_size, projection_dim, bias=False)

    def forward(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Embeddings of texts of any lengths (1..max_position_embeddings tokens each), run
        as one right-padded batch. The causal mask alone keeps padding out: a real token
        attends only to tokens before it, never to the padding after the text, so each row
        equals the text run alone (up to float rounding of the batched matmuls)."""
        padded = self._padded(token_ids)
        num_tokens = padded.shape[1]
        positions = torch.arange(num_tokens, device=padded.device)
        x = self.token_embedding(padded) + self.position_embedding(positions)
        for layer in self.layers:
            x = layer(x, is_causal=True)
        x = self.final_layer_norm(x)
        rows = torch.arange(len(token_ids), device=x.device)
        pooled = x[rows, self.pool_positions(token_ids).to(x.device)]
        return self.projection(pooled)

    def pool_positions(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Where each text is pooled, as transformers' CLIPTextTransformer: with the legacy
        eos_token_id 2, the first largest id; otherwise the first eos_token_id, and position
        0 when the text has none (transformers' argmax over all-False)."""
        positions = []
        for ids in token_ids:
            if self.config.eos_token_id == LEGACY_EOS_TOKEN_ID:
                positions.append(max(range(len(ids)), key=lambda i: (ids[i], -i)))
            else:
                positions.append(
                    next((i for i, t in enumerate(ids) if t == self.config.eos_token_id), 0)
                )
        return torch.tensor(positions, dtype=torch.long)

    def _padded(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        limit, vocab_size = self.config.max_position_embeddings, self.config.vocab_size
        if not token_ids:
            raise ValueError("no texts to embed")
        for index, ids in enumerate(token_ids):
            if not 1 <= len(ids) <= limit:
                raise ValueError(
                    f"text {index} has {len(ids)} tokens; CLIP's text tower "
                    f"takes 1 to max_position_embeddings={limit} tokens"
                )
            if min(ids) < 0 or max(ids) >= vocab_size:
                raise ValueError(
                    f"text {index} has a token id outside the vocabulary [0, {vocab_size})"
                )
        num_tokens = max(len(ids) for ids in token_ids)
        padded = torch.zeros(len(token_ids), num_tokens, dtype=torch.long)
        for row, ids in enumerate(token_ids):
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return padded.to(self.token_embedding.weight.device)


class ClipVisionTower(nn.Module):
    """Pixel values [N, 3, image_size, image_size] -> projected CLS embedding, or the hidden
    states after any encoder layer (LLaVA's `vision_feature_layer`)."""

    def __init__(self, config: ClipVisionConfig, projection_dim: int | None) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.patch_embedding = nn.Conv2d(
            config.num_channels, hidden, config.patch_size, stride=config.patch_size, bias=False
        )
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding(config.num_patches + 1, hidden)
        self.pre_layrnorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(
            ClipEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.post_layernorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        self.projection = _projection(hidden, projection_dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, projection_dim]: transformers' `get_image_features`."""
        if self.projection is None:
            raise ValueError(
                "this vision tower was loaded without visual_projection; use hidden_states()"
            )
        x = self.hidden_states(pixel_values, -1)
        return self.projection(self.post_layernorm(x[:, 0]))

    def hidden_states(self, pixel_values: torch.Tensor, layer: int) -> torch.Tensor:
        """[N, num_patches + 1, hidden]: transformers' `hidden_states[layer]`, where index 0
        is the embeddings after pre_layrnorm, index i the output of encoder layer i (1-based,
        no layer norm after it) and negative indices count from the last, so -1 is the last
        layer's output and -2 the one before (LLaVA's default). Runs only the layers needed."""
        num_states = len(self.layers) + 1
        if not -num_states <= layer < num_states:
            raise IndexError(
                f"layer {layer} is out of range for {num_states} hidden states "
                f"(embeddings + {len(self.layers)} layers)"
            )
        x = self._embed(pixel_values)
        for encoder_layer in self.layers[: layer % num_states]:
            x = encoder_layer(x, is_causal=False)
        return x

    def _embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (
            self.config.num_channels,
            size,
            size,
        ):
            raise ValueError(
                f"pixel_values must be [N, {self.config.num_channels}, {size}, "
                f"{size}], got {list(pixel_values.shape)}"
            )
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.device, weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)  # [N, num_patches, hidden]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding.weight
        return self.pre_layrnorm(x)


class ClipModel(nn.Module):
    """The towers `config` asks for; `logit_scale` (log of the similarity temperature) when
    both are there, as in a CLIPModel checkpoint."""

    def __init__(self, config: ClipConfig) -> None:
        super().__init__()
        self.config = config
        self.text = (
            None if config.text is None else ClipTextTower(config.text, config.projection_dim)
        )
        self.vision = (
            None if config.vision is None else ClipVisionTower(config.vision, config.projection_dim)
        )
        self.logit_scale = (
            nn.Parameter(torch.empty(()))
            if self.text is not None and self.vision is not None
            else None
        )

    def text_embeddings(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        if self.text is None:
            raise ValueError("this CLIP model has no text tower")
        return self.text(token_ids)

    def image_embeddings(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if self.vision is None:
            raise ValueError("this CLIP model has no vision tower")
        return self.vision(pixel_values)


_RENAMES = (
    ("text_model.embeddings.", "text."),
    ("text_model.encoder.", "text."),
    ("text_model.", "text."),
    ("vision_model.embeddings.", "vision."),
    ("vision_model.encoder.", "vision."),
    ("vision_model.", "vision."),
    ("text_projection.", "text.projection."),
    ("visual_projection.", "vision.projection."),
)
# Buffers (arange) that transformers before 4.31 saved with the weights; not parameters.
_IGNORED_SUFFIXES = ("embeddings.position_ids",)


def checkpoint_name_to_parameter(name: str) -> str | None:
    """The ClipModel parameter a checkpoint tensor (prefix stripped) fills; None for a
    tensor that carries nothing (an old checkpoint's position_ids buffer)."""
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_clip(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    prefix: str = "",
    config: ClipConfig | None = None,
    device: str | torch.device = "cpu",
) -> ClipModel:
    """A ClipModel from `folder`'s `*.safetensors` (and its config.json unless `config` is
    given). Every tensor whose name starts with `prefix` must fill a parameter, and every
    parameter must be filled, or ValueError names the tensor. `prefix` selects the CLIP
    tensors of a bigger checkpoint, e.g. `vision_tower.` for LLaVA's
    `vision_tower.vision_model.*` with `ClipConfig(text=None, vision=..., projection_dim=None)`;
    tensors outside it are left to their owner."""
    folder = Path(folder)
    config = config or ClipConfig.from_folder(folder)
    with torch.device("meta"):
        model = ClipModel(config)
    model = model.to(dtype).to_empty(device=device)  # allocated once, in `dtype`

    def target(key: str) -> str | None:
        return checkpoint_name_to_parameter(key[len(prefix) :]) if key.startswith(prefix) else None

    fill_from_safetensors(model, folder, target, f"the CLIP model (prefix {prefix!r})")
    return model.eval()


def fill_from_safetensors(
    module: nn.Module, folder: Path, target: Callable[[str], str | None], what: str
) -> None:
    """Copies each tensor of `folder`'s `*.safetensors` into `module`'s parameter
    `target(name)` (None: not this module's tensor). ValueError naming the tensor when its
    target is no parameter or has another shape, or naming the parameters left unfilled."""
    parameters = dict(module.named_parameters())
    filled: set[str] = set()
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {folder}")
    for file in files:
        with safe_open(file, framework="pt") as tensors:
            for key in tensors.keys():
                name = target(key)
                if name is None:
                    continue
                if name not in parameters:
                    raise ValueError(
                        f"checkpoint tensor {key!r} ({file.name}) has no place in "
                        f"{what} (no parameter {name!r})"
                    )
                _fill(parameters[name], tensors.get_tensor(key), key)
                filled.add(name)
    missing = sorted(set(parameters) - filled)
    if missing:
        raise ValueError(
            f"{len(missing)} parameters of {what} have no tensor in {folder}: "
            f"{', '.join(missing[:8])}"
        )


def _fill(parameter: nn.Parameter, tensor: torch.Tensor, key: str) -> None:
    if tuple(tensor.shape) != tuple(parameter.shape):
        raise ValueError(
            f"checkpoint tensor {key!r} has shape {list(tensor.shape)}, the "
            f"model expects {list(parameter.shape)}"
        )
    with torch.no_grad():
        parameter.copy_(tensor)
