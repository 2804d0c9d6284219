"""Images in a decoder's prompt (vision-language models): the embeddings that replace an
image's placeholder tokens, with an encoder cache keyed by the image's content.

The first pipeline stage of a vision-language model holds an image encoder (the vision
tower and projector, e.g. worker_svc/model/llava.py): encoded bytes in, one embedding row
per placeholder token out. `ImageEmbedder.overrides` turns a step's `ImageSegment`s (the
rows of the batch each image fills; a chunked prefill may cover any part of an image) into
the (rows, embeddings) the model's embedding layer takes. An image is encoded once while it
stays in the cache, whichever requests (and steps) use it: the cache holds the last
`max_cached_images` images' embeddings, least recently used out first.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from protos.step import ImageInput
from worker_svc.batch import ImageSegment

# Encoded images in, [num_placeholders, hidden] per image out, in order.
ImageEncoder = Callable[[list[bytes]], list[torch.Tensor]]


class ImageEmbedder:
    def __init__(
        self, encoder: ImageEncoder, num_placeholders: int, max_cached_images: int = 256
    ) -> None:
        self.encoder = encoder
        self.num_placeholders = num_placeholders  # embedding rows of one image
        self.max_cached_images = max_cached_images
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the encoder since start
        self.encode_time_s = 0.0  # wall time in the encoder (decode, preprocess, tower)
        self.num_cache_hits = 0  # images found in the cache since start

    def overrides(
        self, segments: list[ImageSegment], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [n], embeddings [n, hidden]) for the segments' rows; None for none."""
        if not segments:
            return None
        embeddings = self._embeddings([segment.image for segment in segments])
        rows, parts = [], []
        for segment, image_rows in zip(segments, embeddings):
            if segment.image.length != image_rows.shape[0]:
                raise ValueError(
                    f"an image has {segment.image.length} placeholder tokens, "
                    f"but the model embeds it as {image_rows.shape[0]} rows"
                )
            rows.append(torch.arange(segment.start_row, segment.start_row + segment.count))
            parts.append(image_rows[segment.first : segment.first + segment.count])
        return torch.cat(rows).to(device), torch.cat(parts)

    def _embeddings(self, images: list[ImageInput]) -> list[torch.Tensor]:
        keys = [image.digest for image in images]
        missing: dict[bytes, bytes] = {}
        for key, data in zip(keys, (image.data for image in images)):
            if key in self._cache:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
            else:
                missing.setdefault(key, data)
        if missing:
            started = time.perf_counter()
            encoded = self.encoder(list(missing.values()))
            self.encode_time_s += time.perf_counter() - started
            self.num_encoded += len(missing)
            for key, rows in zip(missing, encoded):
                self._cache[key] = rows
        found = [self._cache[key] for key in keys]
        while len(self._cache) > self.max_cached_images:
            self._cache.popitem(last=False)
        return found


def llava_image_embedder(metadata, device: torch.device | str) -> ImageEmbedder:
    """A LLaVA folder's image encoder (`metadata.path`, in the model's dtype) behind the
    cache: images decoded and preprocessed by its `preprocessor_config.json`."""
    from pagemesh.runtime.images import ClipImageProcessor, load_image
    from worker_svc.model.llava import load_llava_encoder

    encoder = load_llava_encoder(metadata.path, metadata.dtype, device=device)
    if encoder.config.anyres:
        return ImageEmbedder(_anyres_encoder(encoder, metadata, device), metadata.image_seq_length)
    processor = ClipImageProcessor.from_folder(metadata.path)

    @torch.inference_mode()
    def encode(images: list[bytes]) -> list[torch.Tensor]:
        pixels = processor.preprocess([load_image(data) for data in images])
        features = encoder(torch.from_numpy(pixels).to(device, metadata.dtype))
        return list(features)

    return ImageEmbedder(encode, metadata.image_seq_length)


def _anyres_encoder(encoder, metadata, device: torch.device | str) -> ImageEncoder:
    """LLaVA-NeXT: each image's tiles through the tower at once (every image's tiles in
    one batch), then laid out per image (`LlavaImageEncoder.pack_anyres`)."""
    from pagemesh.runtime.images import load_image
    from pagemesh.runtime.images_anyres import AnyResImageProcessor

    processor = AnyResImageProcessor.from_folder(metadata.path)

    @torch.inference_mode()
    def encode(images: list[bytes]) -> list[torch.Tensor]:
        tiles, sizes = zip(*(processor.preprocess(load_image(data)) for data in images))
        pixels = torch.from_numpy(np.concatenate(tiles)).to(device, metadata.dtype)
        features = encoder(pixels).split([len(t) for t in tiles])
        return [encoder.pack_anyres(f, size) for f, size in zip(features, sizes)]

    return encode
