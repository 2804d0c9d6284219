"""pagemesh.runtime.images_anyres: LLaVA-NeXT's anyres preprocessing and image-token count, checked
against real transformers: pixel values against `LlavaNextImageProcessorPil` (exact, max abs
diff 0.0: both resize with Pillow on the same uint8 pixels, pad with zeros and run the same
float64 rescale / float32 normalize), token counts against what `LlavaNextProcessor` expands
one `<image>` into and against the rows `LlavaNextModel.pack_image_features` packs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from pagemesh.runtime.images import CLIP_MEAN, CLIP_STD
from pagemesh.runtime.images_anyres import (
    DEFAULT_GRID_PINPOINTS,
    AnyResImageProcessor,
    grid_shape,
    num_feature_rows,
    num_image_tokens,
    num_patches,
    select_best_resolution,
    unpadded_shape,
)

PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
TILE, PATCH = 32, 8
TINY = {
    "do_resize": True,
    "size": {"shortest_edge": 32},
    "resample": 3,
    "do_center_crop": True,
    "crop_size": {"height": 32, "width": 32},
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": list(CLIP_MEAN),
    "image_std": list(CLIP_STD),
    "do_convert_rgb": True,
    "do_pad": True,
    "image_grid_pinpoints": PINPOINTS,
}


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def alpha_image(width: int, height: int) -> Image.Image:
    image = random_image(width, height, "RGBA", seed=1)
    alpha = np.tile(np.linspace(0, 255, width, dtype=np.uint8), (height, 1))
    image.putalpha(Image.fromarray(alpha))
    return image


def random_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    # (47, 188), (49, 49), (98, 49): the scaled side is 2.9999999999999996 etc., which
    # transformers rounds to 7 decimals before int().
    edges = [
        (1, 1),
        (1, 200),
        (200, 1),
        (32, 64),
        (64, 32),
        (5, 7),
        (200, 200),
        (33, 97),
        (47, 188),
        (49, 49),
        (98, 49),
        (49, 147),
    ]
    return edges + [(int(h), int(w)) for h, w in rng.integers(1, 201, (count, 2))]


IMAGES = {
    "tall": lambda: random_image(40, 120, seed=2),
    "wide": lambda: random_image(120, 40, seed=3),
    "square": lambda: random_image(50, 50, seed=4),
    "tiny-5x7": lambda: random_image(7, 5, seed=5),
    "larger-than-every-pinpoint": lambda: random_image(300, 250, seed=6),
    "one-pixel-wide": lambda: random_image(1, 200, seed=7),
    "odd-padding": lambda: random_image(33, 65, seed=8),
    "rgba": lambda: alpha_image(70, 30),
    "grayscale": lambda: random_image(45, 33, "L", seed=9),
    "palette": lambda: random_image(20, 90, seed=10).convert("P"),
}


# Pixel values against LlavaNextImageProcessorPil -------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        # Tiles not a multiple of the pinpoints (16-pixel edge tiles), resized up by the per-patch
        # shortest edge 40 then cropped to 32; bilinear.
        {
            **TINY,
            "size": {"shortest_edge": 40},
            "resample": 2,
            "image_grid_pinpoints": [[48, 80], [80, 48], [64, 64]],
        },
        # size as height/width: the base patch is squashed to 40x40, every patch cropped to 32.
        {**TINY, "size": {"height": 40, "width": 40}},
        {**TINY, "do_rescale": False, "image_mean": [127.5] * 3, "image_std": [60.0] * 3},
    ],
    ids=["tiny", "uneven-tiles-bilinear", "height-width", "no-rescale"],
)
def test_pixel_values_match_transformers_pil_exactly(tmp_path, config: dict) -> None:
    from transformers import LlavaNextImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    ours = AnyResImageProcessor.from_folder(tmp_path)
    theirs = LlavaNextImageProcessorPil.from_pretrained(tmp_path)
    for name, make in IMAGES.items():
        image = make()
        pixel_values, size = ours.preprocess(image)
        reference = theirs(image, return_tensors="np")
        expected = reference["pixel_values"][0]
        assert size == tuple(int(x) for x in reference["image_sizes"][0]), name
        assert pixel_values.dtype == np.float32 and pixel_values.shape == expected.shape, name
        assert len(pixel_values) == ours.num_patches(*size), name
        np.testing.assert_array_equal(pixel_values, expected, err_msg=name)


def test_batch_padding_patches_are_what_is_left_off() -> None:
    """transformers pads each image of a batch to the most patches with zero patches; ours is
    one image, its first num_patches."""
    from transformers import LlavaNextImageProcessorPil

    ours = AnyResImageProcessor.from_dict(TINY)
    images = [random_image(7, 5), random_image(60, 60, seed=1), random_image(100, 30, seed=2)]
    batch = LlavaNextImageProcessorPil(**TINY)(images, return_tensors="np")["pixel_values"]
    assert batch.shape == (3, 5, 3, TILE, TILE)
    for image, padded in zip(images, batch):
        pixel_values, _ = ours.preprocess(image)
        np.testing.assert_array_equal(pixel_values, padded[: len(pixel_values)])
        assert not padded[len(pixel_values) :].any()


def test_from_dict_defaults_are_llava_next_defaults() -> None:
    from transformers import LlavaNextImageProcessorPil

    ours = AnyResImageProcessor.from_dict({})
    theirs = LlavaNextImageProcessorPil()
    assert ours.grid_pinpoints == DEFAULT_GRID_PINPOINTS
    assert [list(p) for p in ours.grid_pinpoints] == theirs.image_grid_pinpoints
    assert ours.tile_size == 224 and ours.base_hw == (224, 224)
    # transformers' class defaults mix a 224 crop with pinpoints made for 336 tiles: a 300x500
    # image gets (336, 672), cut into 2x3 tiles of which the bottom row is 112 high.
    image = random_image(500, 300)
    pixel_values, size = ours.preprocess(image)
    expected = theirs(image, return_tensors="np")["pixel_values"][0]
    assert size == (300, 500) and pixel_values.shape == (7, 3, 224, 224)
    np.testing.assert_array_equal(pixel_values, expected)


def test_select_best_resolution_matches_transformers() -> None:
    from transformers.image_processing_utils import select_best_resolution as theirs

    # Includes ties (two pinpoints of the same area): the first one listed wins.
    pinpoints = PINPOINTS + [[48, 48], [96, 96], [16, 128], [128, 16]]
    for size in random_sizes(60, seed=11):
        assert select_best_resolution(size, pinpoints) == tuple(theirs(size, pinpoints))
    with pytest.raises(ValueError, match="positive"):
        select_best_resolution((0, 5), pinpoints)


# Token counts against LlavaNextProcessor and LlavaNextModel --------------------------------


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return fast


@pytest.mark.parametrize("strategy", ["default", "full"])
@pytest.mark.parametrize("num_additional", [0, 1])
def test_num_image_tokens_matches_llava_next_processor(strategy: str, num_additional: int) -> None:
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    processor = LlavaNextProcessor(
        image_processor=LlavaNextImageProcessorPil(**TINY),
        tokenizer=_tokenizer(),
        patch_size=PATCH,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=num_additional,
    )
    sizes = random_sizes(30, seed=12)
    images = [Image.new("RGB", (w, h)) for h, w in sizes]
    input_ids = processor(text=["hi <image> hi"] * len(images), images=images)["input_ids"]
    declared = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
    for (h, w), ids, theirs in zip(sizes, input_ids, declared):
        expanded = sum(1 for token in ids if token == processor.image_token_id)
        ours = num_image_tokens(
            h,
            w,
            grid_pinpoints=PINPOINTS,
            tile_size=TILE,
            patch_size=PATCH,
            strategy=strategy,
            num_additional_image_tokens=num_additional,
        )
        assert ours == expanded == theirs, (h, w)


@pytest.fixture(scope="module")
def tiny_llava_next():
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextModel

    torch.manual_seed(0)
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(
            image_size=TILE,
            patch_size=PATCH,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            projection_dim=16,
        ),
        text_config=LlamaConfig(
            vocab_size=64,
            hidden_size=24,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        ),
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_token_index=3,
    )
    return LlavaNextModel(config).eval()


@pytest.mark.parametrize("strategy, num_additional", [("default", 1), ("full", 0)])
def test_num_image_tokens_equals_pack_image_features_rows(
    tiny_llava_next, strategy: str, num_additional: int
) -> None:
    """pack_image_features gets (tile/patch)^2 features per patch (after "default" drops CLS,
    or from a backbone without CLS under "full"): the processor's count equals its rows with
    num_additional_image_tokens 1 for "default", 0 for "full"."""
    import torch
    from transformers.models.llava_next.modeling_llava_next import (
        get_anyres_image_grid_shape,
        image_size_to_num_patches,
        unpad_image,
    )

    model, per_side = tiny_llava_next, TILE // PATCH
    generator = torch.Generator().manual_seed(0)
    for h, w in random_sizes(30, seed=13):
        patches = num_patches(h, w, PINPOINTS, TILE)
        assert patches == image_size_to_num_patches((h, w), PINPOINTS, TILE)
        rows, cols = grid_shape(h, w, PINPOINTS, TILE)
        assert (rows, cols) == get_anyres_image_grid_shape((h, w), PINPOINTS, TILE)
        feature_map = torch.zeros(1, rows * per_side, cols * per_side)
        assert (
            unpadded_shape(h, w, rows, cols, per_side) == unpad_image(feature_map, (h, w)).shape[1:]
        )
        features = torch.randn(patches, per_side * per_side, 24, generator=generator)
        packed, lengths = model.pack_image_features(
            [features], torch.tensor([[h, w]]), strategy, model.image_newline
        )
        ours = num_image_tokens(
            h,
            w,
            grid_pinpoints=PINPOINTS,
            tile_size=TILE,
            patch_size=PATCH,
            strategy=strategy,
            num_additional_image_tokens=num_additional,
        )
        assert ours == packed[0].shape[0] == int(lengths[0]), (h, w)
        assert ours == num_feature_rows(
            h, w, grid_pinpoints=PINPOINTS, tile_size=TILE, patch_size=PATCH
        )
        # transformers' surprise: the processor's default num_additional_image_tokens (0)
        # with "default" is one placeholder short of the model's rows.
        assert (
            num_image_tokens(
                h, w, grid_pinpoints=PINPOINTS, tile_size=TILE, patch_size=PATCH, strategy="default"
            )
            == ours - 1
        )


def test_our_pixel_values_through_the_model(tiny_llava_next) -> None:
    """End to end: our pixel values and image size through the tiny model's vision tower,
    projector and packing ("default", CLS dropped) give num_image_tokens rows."""
    import torch

    processor = AnyResImageProcessor.from_dict(TINY)
    for image in (random_image(120, 50), random_image(7, 5, seed=1), alpha_image(33, 97)):
        pixel_values, size = processor.preprocess(image)
        with torch.no_grad():
            out = tiny_llava_next.get_image_features(
                torch.from_numpy(pixel_values),
                torch.tensor([size]),
                vision_feature_select_strategy="default",
            )
        assert out.pooler_output[0].shape[0] == num_image_tokens(
            *size,
            grid_pinpoints=PINPOINTS,
            tile_size=TILE,
            patch_size=PATCH,
            strategy="default",
            num_additional_image_tokens=1,
        )


def test_refusals() -> None:
    with pytest.raises(ValueError, match="strategy"):
        num_image_tokens(
            10, 10, grid_pinpoints=PINPOINTS, tile_size=TILE, patch_size=PATCH, strategy="cls_patch"
        )
    with pytest.raises(ValueError, match="empty"):
        AnyResImageProcessor.from_dict({**TINY, "image_grid_pinpoints": []}).grid_pinpoints
    with pytest.raises(ValueError, match="RGB"):
        AnyResImageProcessor.from_dict({**TINY, "do_convert_rgb": False}).preprocess(
            random_image(10, 10, "L")
        )


def test_module_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys, pagemesh.runtime.images_anyres; "
        "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
