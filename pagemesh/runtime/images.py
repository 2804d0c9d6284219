"""Images of requests: decoding with limits, data URLs, and CLIP's preprocessing.

This runs in the router, so it uses numpy and Pillow only (no torch).

`load_image` refuses what would cost too much before paying for it: the byte size first,
then the pixel count read from the file's header, before a single pixel is decoded (a
decompression bomb, a few KB of PNG that claims 20000x20000, is refused without
allocating its 1.2 GB). It then converts to RGB exactly as transformers'
`image_transforms.convert_to_rgb` does: an image with transparency (RGBA, LA, PA, a palette
or grayscale image with a `transparency` entry) is composited onto white; any other mode
goes through Pillow's `convert("RGB")` (CMYK, palette, grayscale; 16-bit grayscale is
clipped to 0..255 by Pillow, not rescaled, as transformers does too). Like transformers'
`image_utils.load_image` it first applies the EXIF orientation, so a phone's photo is upright.

`ClipImageProcessor` is transformers' `CLIPImageProcessorPil` (the PIL backend; transformers
5 names the torchvision backend `CLIPImageProcessor` and falls back to the PIL one when
torchvision is not installed) step for step: PIL resize of the uint8 image, center crop
with zero padding, rescale in float64 then cast to float32, normalize in float32. Its
output equals transformers' PIL backend bit for bit (max abs diff 0.0 in the tests). The
torchvision backend resizes with torch's bicubic instead of Pillow's, so its pixel values
differ from these in the resized pixels (not measured: torchvision is not installed here).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from protos.step import ImageInput, ImageTiling

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
ACCEPTED_MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
MIB = 1024 * 1024
# OpenAI CLIP's normalization, transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ImageError(ValueError):
    """An image a request carries cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may cost. `max_pixels` is width * height of one image."""

    max_bytes: int = 20 * MIB
    max_pixels: int = 40_000_000
    max_images_per_request: int = 16

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_images_per_request"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ImageLimits.{name} must be positive, got {getattr(self, name)}")


DEFAULT_LIMITS = ImageLimits()


def check_num_images(num_images: int, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """Raise ImageError when one request carries more images than `limits` allow."""
    if num_images > limits.max_images_per_request:
        raise ImageError(
            f"a request may carry at most {limits.max_images_per_request} images, "
            f"got {num_images}; send fewer images per request"
        )


def load_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode PNG/JPEG/WebP/GIF bytes into an RGB image (the first frame of an animation).
    Raises ImageError for empty, oversized, undecodable or truncated data, and for images
    over `limits.max_pixels`, the last checked from the header before decoding."""
    if not data:
        raise ImageError(
            "the image is empty (0 bytes); send the bytes of a PNG, JPEG, WebP or GIF file"
        )
    if len(data) > limits.max_bytes:
        raise ImageError(
            f"the image is {len(data)} bytes, over the limit of "
            f"{limits.max_bytes} bytes; send a smaller or more compressed image"
        )
    image = _open(data)
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"the image is {width}x{height} = {width * height} pixels, over the "
            f"limit of {limits.max_pixels} pixels; send a smaller image"
        )
    _decode(image)
    ImageOps.exif_transpose(image, in_place=True)
    return convert_to_rgb(image)


def _open(data: bytes) -> Image.Image:
    """Read the header only. Pillow's own bomb check runs here too (at twice its
    MAX_IMAGE_PIXELS it raises, above it it warns); both become ImageError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=list(ACCEPTED_FORMATS))
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise ImageError(
            f"the image has too many pixels to decode safely ({error}); send a smaller image"
        ) from error
    except (Image.UnidentifiedImageError, OSError, SyntaxError, ValueError) as error:
        raise ImageError(
            f"the data is not a decodable image; accepted formats are {', '.join(ACCEPTED_FORMATS)}"
        ) from error


def _decode(image: Image.Image) -> None:
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise ImageError(
            f"the {image.format} image could not be decoded ({error}); the file "
            "is truncated or corrupt, send the complete file"
        ) from error


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb` for a PIL image: transparency composited onto white."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def parse_data_url(url: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a `data:image/<type>;base64,<payload>` URL. Whitespace in the payload
    (line-wrapped base64) is ignored. With `max_bytes`, a payload that would decode to more
    is refused before decoding."""
    if not url.startswith("data:"):
        raise ImageError(
            "an image URL must be a data URL (data:image/png;base64,<base64 "
            "bytes>) or an http(s) URL from a host the router allows"
        )
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise ImageError(
            "the data URL has no ',' between its media type and its payload; "
            "write data:image/png;base64,<base64 bytes>"
        )
    media_type, *parameters = header.split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        raise ImageError(
            f"the data URL's media type is {media_type or 'missing'!r}, not an "
            f"image; use one of {', '.join(ACCEPTED_MEDIA_TYPES)}"
        )
    if media_type not in ACCEPTED_MEDIA_TYPES:
        raise ImageError(
            f"images of type {media_type!r} are not accepted; use one of "
            f"{', '.join(ACCEPTED_MEDIA_TYPES)}"
        )
    if not parameters or parameters[-1].strip().lower() != "base64":
        raise ImageError("the data URL must be base64-encoded: data:image/png;base64,<bytes>")
    payload = "".join(payload.split())
    if max_bytes is not None and len(payload) // 4 * 3 - 2 > max_bytes:
        raise ImageError(
            f"the image is about {len(payload) // 4 * 3} bytes, over the limit of "
            f"{max_bytes} bytes; send a smaller or more compressed image"
        )
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"the data URL's payload is not valid base64 ({error})") from error


@dataclass(frozen=True)
class ClipImageProcessor:
    """CLIP's image preprocessing; defaults are transformers' CLIPImageProcessor defaults.

    Resize either the shorter side to `shortest_edge` pixels (aspect kept, the longer side
    truncated to an int) or to exactly `resize_hw` (height, width); then center-crop to
    `crop_hw`, padding with black where the image is smaller."""

    do_resize: bool = True
    shortest_edge: int | None = 224
    resize_hw: tuple[int, int] | None = None
    resample: int = 3  # Pillow's filter number: 3 is bicubic
    do_center_crop: bool = True
    crop_hw: tuple[int, int] = (224, 224)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if self.do_resize and (self.shortest_edge is None) == (self.resize_hw is None):
            raise ValueError("resizing needs exactly one of shortest_edge and resize_hw")
        if self.resample not in {int(f) for f in Image.Resampling}:
            raise ValueError(f"resample {self.resample} is not a Pillow filter number")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError("image_mean and image_std need one value per RGB channel")
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"image_std must be positive, got {self.image_std}")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ClipImageProcessor:
        """From a `preprocessor_config.json`'s keys; keys it lacks keep their defaults."""
        defaults = cls()
        size = config.get("size", {"shortest_edge": defaults.shortest_edge})
        if isinstance(size, int):  # legacy: an int is the shortest edge for CLIP
            size = {"shortest_edge": size}
        if config.get("use_square_size") and "shortest_edge" in size:  # KOSMOS-2's legacy key
            size = {"height": size["shortest_edge"], "width": size["shortest_edge"]}
        if set(size) == {"shortest_edge"}:
            shortest_edge, resize_hw = int(size["shortest_edge"]), None
        elif set(size) == {"height", "width"}:
            shortest_edge, resize_hw = None, (int(size["height"]), int(size["width"]))
        else:
            raise ValueError(
                f"unsupported size {size}: expected {{'shortest_edge': N}} or "
                "{'height': H, 'width': W}"
            )
        crop = config.get("crop_size", dict(zip(("height", "width"), defaults.crop_hw)))
        crop_hw = (crop, crop) if isinstance(crop, int) else (crop["height"], crop["width"])
        return cls(
            do_resize=bool(config.get("do_resize", defaults.do_resize)),
            shortest_edge=shortest_edge,
            resize_hw=resize_hw,
            resample=int(config.get("resample", defaults.resample)),
            do_center_crop=bool(config.get("do_center_crop", defaults.do_center_crop)),
            crop_hw=(int(crop_hw[0]), int(crop_hw[1])),
            do_rescale=bool(config.get("do_rescale", defaults.do_rescale)),
            rescale_factor=float(config.get("rescale_factor", defaults.rescale_factor)),
            do_normalize=bool(config.get("do_normalize", defaults.do_normalize)),
            image_mean=_per_channel(config.get("image_mean", defaults.image_mean)),
            image_std=_per_channel(config.get("image_std", defaults.image_std)),
            do_convert_rgb=bool(config.get("do_convert_rgb", defaults.do_convert_rgb)),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ClipImageProcessor:
        return cls.from_dict(json.loads((Path(path) / "preprocessor_config.json").read_text()))

    def resize_hw_for(self, width: int, height: int) -> tuple[int, int]:
        """The (height, width) an image of `width` x `height` pixels is resized to:
        transformers' `get_resize_output_image_size` with `default_to_square=False`."""
        if self.resize_hw is not None:
            return self.resize_hw
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def preprocess(self, images: list[Image.Image]) -> np.ndarray:
        """Pixel values, float32 [num_images, 3, height, width]. All images must come out
        the same size (always so with a center crop)."""
        if not images:
            raise ValueError("preprocess needs at least one image")
        arrays = [self._one(image) for image in images]
        shapes = {array.shape for array in arrays}
        if len(shapes) > 1:
            raise ValueError(
                f"the images came out in different shapes {sorted(shapes)}; "
                "enable do_center_crop or resize to a fixed height and width"
            )
        return np.stack(arrays).astype(np.float32, copy=False)

    def _one(self, image: Image.Image) -> np.ndarray:
        if self.do_convert_rgb:
            image = convert_to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"do_convert_rgb is off and the image's mode is {image.mode}, not RGB")
        if self.do_resize:
            height, width = self.resize_hw_for(*image.size)
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image)  # [height, width, 3] uint8
        if self.do_center_crop:
            pixels = _center_crop(pixels, *self.crop_hw)
        if self.do_rescale:
            # As transformers: multiply in float64, then cast, so the float32 values agree.
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels.astype(np.float32, copy=False)
            mean = np.array(self.image_mean, dtype=np.float32)
            std = np.array(self.image_std, dtype=np.float32)
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _per_channel(value: float | list[float]) -> tuple[float, float, float]:
    """A mean or std as one value per channel (transformers also takes one float)."""
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    return tuple(float(v) for v in value)


def _center_crop(pixels: np.ndarray, crop_height: int, crop_width: int) -> np.ndarray:
    """transformers' `center_crop` on [height, width, channels]: the window's corner is
    rounded down; an image smaller than the window is first padded with zeros, its extra
    row/column (for odd differences) going before the image."""
    height, width = pixels.shape[:2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    if top >= 0 and left >= 0:
        return pixels[top : top + crop_height, left : left + crop_width]
    padded_height, padded_width = max(crop_height, height), max(crop_width, width)
    top_pad = -(-(padded_height - height) // 2)  # ceil
    left_pad = -(-(padded_width - width) // 2)
    padded = np.zeros((padded_height, padded_width) + pixels.shape[2:], dtype=pixels.dtype)
    padded[top_pad : top_pad + height, left_pad : left_pad + width] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[
        max(0, top) : min(padded_height, top + crop_height),
        max(0, left) : min(padded_width, left + crop_width),
    ]


def image_token_count(
    image: Image.Image, image_seq_length: int, tiling: ImageTiling = ImageTiling()
) -> int:
    """The placeholder tokens `image` becomes: `image_seq_length` each, or with a LLaVA-NeXT
    `tiling`, as many rows as the model makes of its size (pagemesh/runtime/images_anyres.py; what
    LlavaNextProcessor expands it to with llava-hf's num_additional_image_tokens 1)."""
    if not tiling:
        return image_seq_length
    from pagemesh.runtime.images_anyres import num_feature_rows

    width, height = image.size
    return num_feature_rows(
        height,
        width,
        grid_pinpoints=tiling.grid_pinpoints,
        tile_size=tiling.tile_size,
        patch_size=tiling.patch_size,
    )


def expand_images(
    token_ids: list[int], images: list[bytes], image_token_id: int, counts: int | list[int]
) -> tuple[list[int], tuple[ImageInput, ...]]:
    """Each image token of `token_ids` repeated as many times as its image has embedding
    rows (`counts`: one for every image, or one per image), with the images over them in
    order. ValueError when the image tokens and the images do not pair up."""
    positions = [i for i, token in enumerate(token_ids) if token == image_token_id]
    if len(positions) != len(images):
        raise ValueError(
            f"the prompt has {len(positions)} image token(s) for {len(images)} "
            "image(s): put one image token (e.g. <image>) where each image goes"
        )
    counts = [counts] * len(images) if isinstance(counts, int) else counts
    out: list[int] = []
    inputs = []
    previous = 0
    for position, data, count in zip(positions, images, counts):
        out += token_ids[previous:position]
        inputs.append(ImageInput(data, len(out), count, hashlib.sha256(data).digest()))
        out += [image_token_id] * count
        previous = position + 1
    return out + token_ids[previous:], tuple(inputs)
