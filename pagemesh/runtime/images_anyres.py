"""LLaVA-NeXT's "anyres" image preprocessing and its image-token count, numpy + Pillow only.

This runs in the router (no torch, no transformers). `AnyResImageProcessor.preprocess` equals
transformers' `LlavaNextImageProcessorPil` (the PIL backend; transformers 5 falls back to it for
`LlavaNextImageProcessor` when torchvision is missing) bit for bit, for one image:

1. Convert to RGB as `pagemesh.runtime.images.convert_to_rgb`; its (height, width) is `image_sizes`.
2. Pick the grid pinpoint (height, width) with `select_best_resolution`: the most effective
   pixels (the image scaled to fit inside it, never counted above its own pixel count), ties
   broken by the least wasted area, then by list order.
3. Resize (Pillow, the configured filter) to fit that pinpoint, aspect kept: the side that
   limits the scale becomes the pinpoint's, the other `min(ceil(side * scale), pinpoint side)`.
   Pad with zeros (black) to the pinpoint, centred: the extra row/column goes after.
4. Cut it into square tiles of side crop_size["height"], row by row (the last ones are smaller
   when the pinpoint is not a multiple of the tile; real configs never do that, but
   transformers' class defaults do: a 224 crop with pinpoints for 336. Then `num_patches`
   counts the partial tiles, as transformers does, and `grid_shape` floors them away, as
   the model does, so the model cannot take those pixel values).
5. The base patch, first: the whole image resized (squashed) to (size.height, size.width), or to
   shortest_edge x shortest_edge.
6. Each patch then goes through CLIP's steps (`ClipImageProcessor`): resize, center crop, rescale
   in float64 then cast to float32, normalize in float32.

`num_image_tokens` is `LlavaNextProcessor`'s count of `<image>` placeholders for one image:
(tile/patch)^2 + num_additional_image_tokens base features, plus the grid's feature map
(rows*tile/patch x cols*tile/patch) after `unpad_image` removes what fell on the padding, plus
one image_newline per remaining row; minus 1 when the strategy is "default". The model
(`LlavaNextModel.pack_image_features`) packs (tile/patch)^2 + the same unpadded map + newlines,
so the two agree only when num_additional_image_tokens is 1 with "default" (CLIP backbones, as
llava-hf's processor_config.json sets it) or 0 with "full" (a backbone without CLS). The
processor's default num_additional_image_tokens is 0, which with "default" is one token short.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from pagemesh.runtime.images import ClipImageProcessor, convert_to_rgb

# LlavaNextImageProcessor's default image_grid_pinpoints, (height, width).
DEFAULT_GRID_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
STRATEGIES = ("default", "full")


def select_best_resolution(
    original_size: tuple[int, int], pinpoints: Iterable[tuple[int, int]]
) -> tuple[int, int]:
    """transformers' `select_best_resolution`: the (height, width) of `pinpoints` that keeps the
    most of the image's pixels when it is scaled to fit, then wastes the least area."""
    original_height, original_width = original_size
    if original_height <= 0 or original_width <= 0:
        raise ValueError(f"an image size must be positive, got {original_size}")
    best_fit = None
    max_effective, min_wasted = 0, float("inf")
    for height, width in pinpoints:
        scale = min(width / original_width, height / original_height)
        downscaled_width, downscaled_height = (
            int(original_width * scale),
            int(original_height * scale),
        )
        effective = min(downscaled_width * downscaled_height, original_width * original_height)
        wasted = width * height - effective
        if effective > max_effective or (effective == max_effective and wasted < min_wasted):
            max_effective, min_wasted = effective, wasted
            best_fit = (int(height), int(width))
    if best_fit is None:
        raise ValueError(f"no grid pinpoint fits an image of size {original_size}: {pinpoints}")
    return best_fit


def fit_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' `get_patch_output_size`: the (height, width) an image is resized to so that
    it fits inside `target` with its aspect kept (the free side rounded up, capped)."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def grid_shape(height: int, width: int, grid_pinpoints, tile_size: int) -> tuple[int, int]:
    """(rows, cols) of tiles of an image of this size: `get_anyres_image_grid_shape`."""
    best_height, best_width = select_best_resolution((height, width), grid_pinpoints)
    return best_height // tile_size, best_width // tile_size


def num_patches(height: int, width: int, grid_pinpoints, tile_size: int) -> int:
    """How many patches `preprocess` returns (base + grid): `image_size_to_num_patches`."""
    best_height, best_width = select_best_resolution((height, width), grid_pinpoints)
    return -(-best_height // tile_size) * -(-best_width // tile_size) + 1


def unpadded_shape(
    height: int, width: int, rows: int, cols: int, patches_per_side: int
) -> tuple[int, int]:
    """The (h, w) of the grid's feature map (rows*p x cols*p) after `unpad_image` cuts what
    fell on the padding: int(round(x, 7)) for the scaled side, padding // 2 off each end."""
    current_height, current_width = rows * patches_per_side, cols * patches_per_side
    if width / height > current_width / current_height:
        new_height = int(round(height * (current_width / width), 7))
        current_height -= (current_height - new_height) // 2 * 2
    else:
        new_width = int(round(width * (current_height / height), 7))
        current_width -= (current_width - new_width) // 2 * 2
    return current_height, current_width


def num_image_tokens(
    height: int,
    width: int,
    *,
    grid_pinpoints,
    tile_size: int,
    patch_size: int,
    strategy: str,
    num_additional_image_tokens: int = 0,
) -> int:
    """How many placeholder tokens `LlavaNextProcessor` expands one image of this original
    size into (its `_get_number_of_features`, minus 1 for "default"). `tile_size` is the
    processed patch side (crop size = vision_config.image_size), `patch_size` the vision
    patch size; `num_additional_image_tokens` as the processor's (its default 0; llava-hf's
    CLIP checkpoints set 1, the only value for which "default" equals the model's rows)."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"vision_feature_select_strategy must be one of {STRATEGIES}, got {strategy!r}"
        )
    rows, cols = grid_shape(height, width, grid_pinpoints, tile_size)
    per_side = tile_size // patch_size
    unpadded_height, unpadded_width = unpadded_shape(height, width, rows, cols, per_side)
    tokens = (
        per_side * per_side
        + num_additional_image_tokens
        + unpadded_height * unpadded_width
        + unpadded_height
    )
    return tokens - 1 if strategy == "default" else tokens


def num_feature_rows(
    height: int, width: int, *, grid_pinpoints, tile_size: int, patch_size: int
) -> int:
    """The rows `LlavaNextModel.pack_image_features` makes of one image, whose vision features
    are (tile/patch)^2 per patch after the strategy's selection: base + unpadded grid +
    one newline per row. The processor's placeholder count must equal this."""
    return num_image_tokens(
        height,
        width,
        grid_pinpoints=grid_pinpoints,
        tile_size=tile_size,
        patch_size=patch_size,
        strategy="full",
    )


@dataclass(frozen=True)
class AnyResImageProcessor:
    """LLaVA-NeXT's image preprocessing: a base (whole image) patch and a grid of tiles, each
    processed by `base` (CLIP's steps from the same preprocessor_config.json)."""

    base: ClipImageProcessor
    grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_GRID_PINPOINTS
    tile_size: int = 224  # the grid's tile side: crop_size["height"], as transformers
    base_hw: tuple[int, int] = (224, 224)  # the whole image is squashed to this (height, width)

    def __post_init__(self) -> None:
        if not self.grid_pinpoints:
            raise ValueError("image_grid_pinpoints is empty")
        if any(len(p) != 2 or min(p) <= 0 for p in self.grid_pinpoints):
            raise ValueError(
                f"image_grid_pinpoints must be positive (height, width) pairs, "
                f"got {self.grid_pinpoints}"
            )
        if self.tile_size <= 0 or min(self.base_hw) <= 0:
            raise ValueError(
                f"tile_size and base_hw must be positive, got {self.tile_size} and {self.base_hw}"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AnyResImageProcessor:
        """From a LLaVA-NeXT `preprocessor_config.json`'s keys (LlavaNextImageProcessor's:
        image_grid_pinpoints, size, crop_size, resample, image_mean/std, ...)."""
        base = ClipImageProcessor.from_dict(config)
        pinpoints = config.get("image_grid_pinpoints")
        if pinpoints is None:
            pinpoints = DEFAULT_GRID_PINPOINTS
        if base.resize_hw is not None:
            base_hw = base.resize_hw
        else:
            base_hw = (base.shortest_edge, base.shortest_edge)
        return cls(
            base=base,
            grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints),
            tile_size=base.crop_hw[0],
            base_hw=base_hw,
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> AnyResImageProcessor:
        return cls.from_dict(json.loads((Path(path) / "preprocessor_config.json").read_text()))

    def num_patches(self, height: int, width: int) -> int:
        return num_patches(height, width, self.grid_pinpoints, self.tile_size)

    def preprocess(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int]]:
        """(pixel values float32 [num_patches, 3, crop_h, crop_w], base patch first, then the
        grid's tiles row by row; the image's original (height, width))."""
        if self.base.do_convert_rgb:
            image = convert_to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"do_convert_rgb is off and the image's mode is {image.mode}, not RGB")
        width, height = image.size
        resample = Image.Resampling(self.base.resample)
        best_height, best_width = select_best_resolution((height, width), self.grid_pinpoints)
        new_height, new_width = fit_size(height, width, (best_height, best_width))
        resized = np.asarray(image.resize((new_width, new_height), resample=resample))
        padded = np.zeros((best_height, best_width, 3), dtype=np.uint8)
        top, left = (best_height - new_height) // 2, (best_width - new_width) // 2
        padded[top : top + new_height, left : left + new_width] = resized
        tile = self.tile_size
        tiles = [
            Image.fromarray(np.ascontiguousarray(padded[i : i + tile, j : j + tile]))
            for i in range(0, best_height, tile)
            for j in range(0, best_width, tile)
        ]
        whole = image.resize((self.base_hw[1], self.base_hw[0]), resample=resample)
        return self.base.preprocess([whole] + tiles), (height, width)
