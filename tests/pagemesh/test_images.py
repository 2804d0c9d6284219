"""pagemesh.runtime.images: decoding with limits, data URLs, RGB conversion and CLIP preprocessing,
checked against transformers' PIL image processor (`CLIPImageProcessorPil`, which
transformers 5 also falls back to for `CLIPImageProcessor` when torchvision is missing).
The bound: exact equality (max abs diff 0.0) of the float32 pixel values, since both resize
with Pillow and do the same float64 rescale and float32 normalize."""

from __future__ import annotations

import base64
import io
import json
import resource
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image

from pagemesh.runtime.images import (
    CLIP_MEAN,
    CLIP_STD,
    ClipImageProcessor,
    ImageError,
    ImageLimits,
    check_num_images,
    load_image,
    parse_data_url,
)


def random_image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    channels = len(Image.new(mode, (1, 1)).getbands())
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels and holds one row of them: what a
    decompression bomb's header looks like, in a few hundred bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\0" * (1 + 3 * width), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


# Decoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, options, lossless",
    [
        ("PNG", {}, True),
        ("JPEG", {"quality": 95}, False),
        ("WEBP", {"lossless": True}, True),
        ("GIF", {}, False),  # palette quantization
    ],
)
def test_decodes_accepted_formats(fmt: str, options: dict, lossless: bool) -> None:
    image = random_image(20, 12)
    decoded = load_image(encode(image, fmt, **options))
    assert decoded.mode == "RGB" and decoded.size == (20, 12)
    if lossless:
        np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))


def test_applies_exif_orientation_as_transformers_load_image() -> None:
    from transformers.image_utils import load_image as hf_load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: stored 30 wide, shown 20 wide
    data = encode(random_image(30, 20), "JPEG", exif=exif)
    ours = load_image(data)
    theirs = hf_load_image(Image.open(io.BytesIO(data)))
    assert ours.size == theirs.size == (20, 30)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _alpha_image(mode: str) -> Image.Image:
    image = random_image(16, 10, "RGBA", seed=1)
    alpha = np.tile(np.linspace(0, 255, 16, dtype=np.uint8), (10, 1))
    image.putalpha(Image.fromarray(alpha))
    return image.convert(mode)


def _palette_with_transparency() -> Image.Image:
    image = random_image(16, 10).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    image.info["transparency"] = 3
    return image


def _gray16() -> Image.Image:
    values = np.linspace(0, 1000, 160, dtype=np.uint16).reshape(10, 16)
    return Image.fromarray(values)  # mode I;16


@pytest.mark.parametrize(
    "make, fmt",
    [
        (lambda: _alpha_image("RGBA"), "PNG"),
        (lambda: _alpha_image("LA"), "PNG"),
        (_palette_with_transparency, "PNG"),
        (lambda: random_image(16, 10).convert("P"), "GIF"),
        (lambda: random_image(16, 10, "L"), "PNG"),
        (lambda: random_image(16, 10).convert("1"), "PNG"),
        (lambda: random_image(16, 10).convert("CMYK"), "JPEG"),
        (_gray16, "PNG"),
    ],
    ids=["RGBA", "LA", "P+transparency", "P-gif", "L", "1", "CMYK-jpeg", "I;16"],
)
def test_converts_to_rgb_as_transformers(make, fmt: str) -> None:
    from transformers.image_transforms import convert_to_rgb

    data = encode(make(), fmt)
    ours = load_image(data)
    theirs = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    assert ours.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_transparent_pixels_become_white() -> None:
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(load_image(encode(image, "PNG"))).min() == 255


# Refusals ----------------------------------------------------------------------------------


def test_refuses_empty_and_oversized_data() -> None:
    with pytest.raises(ImageError, match="empty"):
        load_image(b"")
    data = encode(random_image(64, 64), "PNG")
    with pytest.raises(ImageError, match=f"{len(data)} bytes, over the limit of 1000"):
        load_image(data, ImageLimits(max_bytes=1000))
    assert issubclass(ImageError, ValueError)


@pytest.mark.parametrize(
    "data",
    [
        b"certainly not an image",
        encode(random_image(8, 8), "BMP"),
        encode(random_image(8, 8), "TIFF"),
    ],
    ids=["garbage", "bmp", "tiff"],
)
def test_refuses_undecodable_or_unaccepted_formats(data: bytes) -> None:
    with pytest.raises(ImageError, match="PNG, JPEG, WEBP, GIF"):
        load_image(data)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_refuses_truncated_files(fmt: str) -> None:
    data = encode(random_image(64, 64), fmt)
    with pytest.raises(ImageError, match="truncated"):
        load_image(data[: len(data) * 2 // 3])


def test_refuses_too_many_pixels_from_the_header() -> None:
    data = encode(random_image(16, 16), "PNG")
    with pytest.raises(ImageError, match="16x16 = 256 pixels, over the limit of 255"):
        load_image(data, ImageLimits(max_pixels=255))
    assert load_image(data, ImageLimits(max_pixels=256)).size == (16, 16)


@pytest.mark.parametrize(
    "width, height, message",
    [
        # 48 megapixels: under Pillow's own bomb thresholds (89M warns, 179M raises), so this
        # is our check, made before decoding (this file holds one row; decoding would fail).
        (8000, 6000, "8000x6000 = 48000000 pixels, over the limit of 40000000"),
        # 400 megapixels, 1.2 GB decoded: Pillow's DecompressionBombError, as an ImageError.
        (20000, 20000, "too many pixels"),
    ],
)
def test_refuses_decompression_bombs_without_decoding(
    width: int, height: int, message: str
) -> None:
    data = png_header_only(width, height)
    assert len(data) < 1000
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    with pytest.raises(ImageError, match=message):
        load_image(data)
    assert time.perf_counter() - start < 0.5
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mib < 64, f"refusing the bomb raised peak memory by {grown_mib:.0f} MiB"


def test_check_num_images() -> None:
    check_num_images(16)
    with pytest.raises(ImageError, match="at most 2 images, got 3"):
        check_num_images(3, ImageLimits(max_images_per_request=2))
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


# Data URLs ---------------------------------------------------------------------------------


def test_parses_data_urls() -> None:
    data = encode(random_image(8, 8), "PNG")
    payload = base64.b64encode(data).decode()
    assert parse_data_url(f"data:image/png;base64,{payload}") == data
    wrapped = "\n".join(payload[i : i + 76] for i in range(0, len(payload), 76))
    assert parse_data_url(f"data:IMAGE/JPEG;base64,{wrapped}") == data
    assert load_image(parse_data_url(f"data:image/webp;base64,{payload}")).size == (8, 8)


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://example.com/cat.png", "must be a data URL"),
        ("data:image/png;base64", "no ','"),
        ("data:text/plain;base64,aGVsbG8=", "not an image"),
        ("data:;base64,aGVsbG8=", "not an image"),
        ("data:image/svg+xml;base64,aGVsbG8=", "'image/svg\\+xml' are not accepted"),
        ("data:image/png,%89PNG", "base64-encoded"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
        ("data:image/png;base64,aGVsbG8", "not valid base64"),  # missing padding
    ],
)
def test_refuses_malformed_data_urls(url: str, message: str) -> None:
    with pytest.raises(ImageError, match=message):
        parse_data_url(url)


def test_data_url_size_checked_before_decoding() -> None:
    payload = base64.b64encode(bytes(3000)).decode()
    assert len(parse_data_url(f"data:image/png;base64,{payload}", max_bytes=3000)) == 3000
    with pytest.raises(ImageError, match="over the limit of 2990 bytes"):
        parse_data_url(f"data:image/png;base64,{payload}", max_bytes=2990)


# The CLIP processor against transformers ---------------------------------------------------

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
}


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        {**TINY, "size": {"shortest_edge": 24}},  # smaller than the crop: zero padding
        {**TINY, "size": {"height": 40, "width": 30}, "do_center_crop": False, "resample": 2},
        {"size": 48, "crop_size": 40, "do_normalize": False},  # legacy ints, default mean/std
        {**TINY, "do_rescale": False, "image_mean": [127.5] * 3, "image_std": [60.0] * 3},
        {},  # all defaults: shortest edge 224, crop 224
    ],
    ids=["tiny", "pad", "height-width-bilinear", "legacy-ints", "no-rescale", "defaults"],
)
def test_processor_matches_transformers_exactly(tmp_path, config: dict) -> None:
    from transformers import CLIPImageProcessorPil

    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    images = [
        random_image(100, 60, seed=2),
        random_image(20, 50, seed=3),
        random_image(32, 32, seed=4),
        random_image(7, 200, seed=5),
        _alpha_image("RGBA"),
        random_image(45, 33, "L", seed=6),
    ]
    ours = ClipImageProcessor.from_folder(tmp_path).preprocess(images)
    theirs = CLIPImageProcessorPil.from_pretrained(tmp_path)(images, return_tensors="np")[
        "pixel_values"
    ]
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


def test_processor_refusals() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        ClipImageProcessor(shortest_edge=None)
    with pytest.raises(ValueError, match="unsupported size"):
        ClipImageProcessor.from_dict({"size": {"shortest_edge": 224, "longest_edge": 448}})
    with pytest.raises(ValueError, match="at least one image"):
        ClipImageProcessor().preprocess([])
    uncropped = ClipImageProcessor(shortest_edge=32, do_center_crop=False)
    with pytest.raises(ValueError, match="different shapes"):
        uncropped.preprocess([random_image(32, 32), random_image(64, 32)])


def test_module_does_not_import_torch() -> None:
    code = "import sys, pagemesh.runtime.images; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
