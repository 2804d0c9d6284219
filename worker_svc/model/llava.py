"""LLaVA (`LlavaForConditionalGeneration`): a CLIP vision tower and a two-layer projector
that turn an image into `image_seq_length` vectors the decoder reads in place of the
`<image>` placeholder tokens' embeddings. The decoder is the repo's `LlamaForCausalLM`,
loaded from the checkpoint's text tensors renamed by `llava_checkpoint_name`.

The image features are transformers' `get_image_features`: the vision tower's hidden
states after `vision_feature_layer` (index 0 is the layer-normed embeddings, -2, the
default, the output of the second-to-last layer; with a list, those layers' states
concatenated along the hidden dimension), without the CLS position under the "default"
strategy, through linear_1, the activation and linear_2. No post_layernorm: its weights
are in the checkpoint and loaded, but LLaVA does not use them.

LLaVA-NeXT (`LlavaNextForConditionalGeneration`, "anyres"): the image is cut into tiles of
the tower's size on the grid `image_grid_pinpoints` fits it best (pagemesh/runtime/images_anyres.py,
as transformers' LlavaNextImageProcessor), plus the whole image resized as a first tile;
every tile goes through the tower and projector, and `pack_anyres` lays the grid's features
out as the image (rows by columns of patches), crops the padding the resize added, ends each
row with the learned `image_newline` vector and puts the whole image's features first, as
transformers' `pack_image_features`: an image becomes as many rows as its size says
(`images_anyres.num_image_tokens`), not a fixed count.

Checkpoint names (`llava_checkpoint_name` takes any of them):
- the Hub's llava-hf layout: `vision_tower.vision_model.*`, `multi_modal_projector.*`,
  `language_model.model.*`, `language_model.lm_head.weight`;
- transformers 5.24's `save_pretrained`: the same, but `vision_tower.*` with no
  `vision_model.` (its CLIPVisionModel has no such submodule);
- transformers 5's in-memory names: `model.vision_tower.*`, `model.multi_modal_projector.*`,
  `model.language_model.*`, `lm_head.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protos.step import ImageTiling
from worker_svc.model.clip import (
    ACTIVATIONS as CLIP_ACTIVATIONS,
)
from worker_svc.model.clip import (
    ClipVisionConfig,
    ClipVisionTower,
    checkpoint_name_to_parameter,
    fill_from_safetensors,
)

# transformers' ACT2FN entries a projector may name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    **CLIP_ACTIVATIONS,  # "gelu" is exact (erf), as ACT2FN["gelu"]
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
STRATEGIES = ("default", "full")  # "default" drops the CLS position, "full" keeps it
# LlavaConfig's vision tower when config.json has no vision_config (llava-1.5-7b's CLIP-L/336).
DEFAULT_VISION = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "patch_size": 14,
    "image_size": 336,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
}
DEFAULT_IMAGE_TOKEN_INDEX = 32000
# LlavaNextConfig's grids when config.json names none.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
# Checkpoint tensor kinds, the first item of `llava_checkpoint_name`.
VISION, PROJECTOR, TEXT, UNUSED = "vision", "projector", "text", "unused"


@dataclass(frozen=True)
class LlavaConfig:
    text: dict[str, Any]  # text_config, for parse_hf_config; model_type always set
    vision: ClipVisionConfig
    image_token_index: int
    vision_feature_layer: int | tuple[int, ...] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True
    # LLaVA-NeXT: the (height, width) grids an image may be tiled to; () for LLaVA-1.5.
    image_grid_pinpoints: tuple[tuple[int, int], ...] = ()

    @property
    def anyres(self) -> bool:
        return bool(self.image_grid_pinpoints)

    @property
    def tiling(self) -> ImageTiling:
        """What the router needs to count an image's placeholders (empty: fixed)."""
        if not self.anyres:
            return ImageTiling()
        return ImageTiling(
            self.image_grid_pinpoints, self.vision.image_size, self.vision.patch_size
        )

    def __post_init__(self) -> None:
        if self.vision_feature_select_strategy not in STRATEGIES:
            raise ValueError(
                f"vision_feature_select_strategy must be one of {STRATEGIES}, "
                f"got {self.vision_feature_select_strategy!r}"
            )
        if self.projector_hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"projector_hidden_act {self.projector_hidden_act!r} is not "
                f"supported; supported: {sorted(ACTIVATIONS)}"
            )
        num_states = self.vision.num_hidden_layers + 1
        for layer in self.feature_layers:
            if not -num_states <= layer < num_states:
                raise ValueError(
                    f"vision_feature_layer {layer} is out of range for {num_states} hidden states"
                )
        if not self.feature_layers:
            raise ValueError("vision_feature_layer is an empty list")
        if self.anyres and self.vision_feature_select_strategy != "default":
            raise ValueError(
                "a LLaVA-NeXT's tiles are laid out without the CLS position: "
                'vision_feature_select_strategy must be "default"'
            )

    @property
    def feature_layers(self) -> tuple[int, ...]:
        layer = self.vision_feature_layer
        return (layer,) if isinstance(layer, int) else tuple(layer)

    @property
    def image_seq_length(self) -> int:
        """Placeholder tokens (and feature vectors) per image; LLaVA-NeXT: per tile (an
        image's count depends on its size)."""
        return self.vision.num_patches + (self.vision_feature_select_strategy == "full")

    @property
    def text_hidden_size(self) -> int:
        return self.text["hidden_size"]

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> LlavaConfig:
        """From a LlavaForConditionalGeneration config.json (missing keys: LlavaConfig's
        defaults; a text_config without model_type is a Llama's, as transformers')."""
        text = dict(config.get("text_config") or {})
        text.setdefault("model_type", "llama")
        vision = config.get("vision_config")
        vision = DEFAULT_VISION if vision is None else vision
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(
                f"only CLIP vision towers are supported, got vision_config "
                f"model_type {vision['model_type']!r}"
            )
        layer = config.get("vision_feature_layer", -2)
        return cls(
            text=text,
            vision=ClipVisionConfig.from_dict(vision),
            image_token_index=config.get(
                "image_token_index", config.get("image_token_id", DEFAULT_IMAGE_TOKEN_INDEX)
            ),
            vision_feature_layer=layer if isinstance(layer, int) else tuple(layer),
            vision_feature_select_strategy=config.get("vision_feature_select_strategy", "default"),
            projector_hidden_act=config.get("projector_hidden_act", "gelu"),
            multimodal_projector_bias=config.get("multimodal_projector_bias", True),
            image_grid_pinpoints=(
                tuple(tuple(p) for p in config.get("image_grid_pinpoints") or DEFAULT_PINPOINTS)
                if is_llava_next(config)
                else ()
            ),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> LlavaConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


def is_llava_config(hf_config: dict[str, Any]) -> bool:
    """Whether a config.json dict is a LlavaForConditionalGeneration's (or LLaVA-NeXT's)."""
    return (
        hf_config.get("model_type") == "llava"
        or is_llava_next(hf_config)
        or "LlavaForConditionalGeneration" in (hf_config.get("architectures") or [])
    )


def is_llava_next(hf_config: dict[str, Any]) -> bool:
    return hf_config.get("model_type") == "llava_next" or "LlavaNextForConditionalGeneration" in (
        hf_config.get("architectures") or []
    )


class MultiModalProjector(nn.Module):
    """[..., vision hidden * len(feature_layers)] -> [..., text hidden]."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        text_hidden, bias = config.text_hidden_size, config.multimodal_projector_bias
        in_features = config.vision.hidden_size * len(config.feature_layers)
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=bias)
        self.act = ACTIVATIONS[config.projector_hidden_act]
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaImageEncoder(nn.Module):
    """Pixel values [N, 3, image_size, image_size] -> [N, image_seq_length, text hidden]:
    what replaces each image's placeholder tokens' embeddings, row i for the i-th one."""

    def __init__(self, config: LlavaConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_tower = ClipVisionTower(config.vision, projection_dim=None)
        self.multi_modal_projector = MultiModalProjector(config)
        if config.anyres:  # ends each row of an image's grid features
            self.image_newline = nn.Parameter(torch.empty(config.text_hidden_size))

    def pack_anyres(self, features: torch.Tensor, image_hw: tuple[int, int]) -> torch.Tensor:
        """One LLaVA-NeXT image's tile features [1 + rows * cols, tile patches, hidden]
        (the whole image's first) -> its rows [n, hidden]: the whole image's features, then
        the grid's as the image (padding cropped), each row ended by `image_newline`."""
        from pagemesh.runtime.images_anyres import grid_shape

        config = self.config
        height, width = image_hw
        side = config.vision.image_size // config.vision.patch_size
        rows, cols = grid_shape(
            height, width, config.image_grid_pinpoints, config.vision.image_size
        )
        hidden = features.shape[-1]
        grid = features[1:].view(rows, cols, side, side, hidden)
        grid = grid.permute(4, 0, 2, 1, 3).reshape(hidden, rows * side, cols * side)
        grid = _unpad(grid, height, width)
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(hidden, grid.shape[1], 1)
        grid = torch.cat([grid, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([features[0], grid], dim=0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        states = self._hidden_states(pixel_values)
        if self.config.vision_feature_select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop CLS
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def _hidden_states(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The tower's hidden states at each feature layer, running each encoder layer
        once and none past the last one needed."""
        num_states = self.config.vision.num_hidden_layers + 1
        indices = [layer % num_states for layer in self.config.feature_layers]
        x = self.vision_tower.hidden_states(pixel_values, 0)  # embeddings, pre_layrnorm'd
        by_index = {0: x}
        for index, layer in enumerate(self.vision_tower.layers[: max(indices)], start=1):
            x = layer(x, is_causal=False)
            by_index[index] = x
        return [by_index[index] for index in indices]


def _unpad(grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The grid's features [hidden, H, W] without the rows or columns that only the padding
    to the grid's aspect covers (transformers' `unpad_image`, to the same rounding)."""
    current_height, current_width = grid.shape[1:]
    if width / height > current_width / current_height:
        new_height = int(round(height * (current_width / width), 7))
        padding = (current_height - new_height) // 2
        return grid[:, padding : current_height - padding, :]
    new_width = int(round(width * (current_height / height), 7))
    padding = (current_width - new_width) // 2
    return grid[:, :, padding : current_width - padding]


def llava_checkpoint_name(name: str) -> tuple[str, str]:
    """(kind, target) for a LLaVA checkpoint tensor of any naming (see the module doc):
    ("vision", LlavaImageEncoder parameter, e.g. `vision_tower.layers.0.mlp.fc1.weight`),
    ("projector", LlavaImageEncoder parameter, `multi_modal_projector.linear_1.weight`),
    ("text", the decoder's HF name, `model.layers.0.self_attn.q_proj.weight` or
    `lm_head.weight`, for LlamaForCausalLM.load_weights), or ("unused", name) for a buffer
    old checkpoints saved (`position_ids`). ValueError for a name of no LLaVA part."""
    rest = name
    if (
        rest.startswith(
            ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.")
        )
        or rest == "model.image_newline"
    ):
        rest = rest[len("model.") :]
    if rest.startswith("vision_tower."):
        rest = rest[len("vision_tower.") :]
        if not rest.startswith("vision_model."):
            rest = "vision_model." + rest
        target = checkpoint_name_to_parameter(rest)
        if target is None:
            return UNUSED, name
        return VISION, "vision_tower." + target[len("vision.") :]
    if rest.startswith("multi_modal_projector.") or rest == "image_newline":
        return PROJECTOR, rest
    if rest == "lm_head.weight" or rest.startswith("language_model.lm_head."):
        return TEXT, "lm_head." + rest.rpartition("lm_head.")[2]
    if rest.startswith("language_model.model."):
        return TEXT, "model." + rest[len("language_model.model.") :]
    if rest.startswith("language_model."):
        return TEXT, "model." + rest[len("language_model.") :]
    raise ValueError(
        f"checkpoint tensor {name!r} belongs to no part of a LLaVA model "
        "(vision_tower, multi_modal_projector, language_model, lm_head)"
    )


def load_llava_encoder(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    config: LlavaConfig | None = None,
    device: str | torch.device = "cpu",
) -> LlavaImageEncoder:
    """The image encoder from `folder`'s `*.safetensors` (and config.json unless `config`
    is given). Text tensors are skipped (the decoder's loader takes them); every vision
    and projector tensor must fill a parameter and every parameter must be filled, or
    ValueError names the tensor or parameter."""
    folder = Path(folder)
    config = config or LlavaConfig.from_folder(folder)
    with torch.device("meta"):
        encoder = LlavaImageEncoder(config)
    encoder = encoder.to(dtype).to_empty(device=device)  # allocated once, in `dtype`

    def target(key: str) -> str | None:
        kind, name = llava_checkpoint_name(key)
        return None if kind in (TEXT, UNUSED) else name

    fill_from_safetensors(encoder, folder, target, "the LLaVA image encoder")
    return encoder.eval()
