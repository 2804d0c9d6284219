"""`PoolingInfo` and `ImageTiling` (protos/step.py) to and from their messages
(generate.proto's), which the worker, the scheduler and the router all carry (each
service's convert.py calls these)."""

from __future__ import annotations

from protos.pagemesh.v1 import generate_pb2
from protos.step import ImageTiling, PoolingInfo


def pooling_info_to_pb(info: PoolingInfo) -> generate_pb2.PoolingInfo:
    return generate_pb2.PoolingInfo(
        task=info.task,
        pooling_type=info.pooling_type,
        normalize=info.normalize,
        embedding_size=info.embedding_size,
        matryoshka_dimensions=list(info.matryoshka_dimensions),
        any_dimensions=info.any_dimensions,
        image_tokens=info.image_tokens,
        max_text_tokens=info.max_text_tokens,
    )


def pooling_info_from_pb(pb: generate_pb2.PoolingInfo) -> PoolingInfo:
    """An unset message (an older peer) is a generating model."""
    return PoolingInfo(
        task=pb.task or "generate",
        pooling_type=pb.pooling_type,
        normalize=pb.normalize,
        embedding_size=pb.embedding_size,
        matryoshka_dimensions=tuple(pb.matryoshka_dimensions),
        any_dimensions=pb.any_dimensions,
        image_tokens=pb.image_tokens,
        max_text_tokens=pb.max_text_tokens,
    )


def image_tiling_to_pb(tiling: ImageTiling) -> generate_pb2.ImageTiling:
    return generate_pb2.ImageTiling(
        grid_pinpoints=[side for pair in tiling.grid_pinpoints for side in pair],
        tile_size=tiling.tile_size,
        patch_size=tiling.patch_size,
    )


def image_tiling_from_pb(pb: generate_pb2.ImageTiling) -> ImageTiling:
    sides = list(pb.grid_pinpoints)
    return ImageTiling(tuple(zip(sides[::2], sides[1::2])), pb.tile_size, pb.patch_size)
