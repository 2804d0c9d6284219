"""`PoolingInfo` (protos/step.py) to and from its message (generate.proto's PoolingInfo),
which the worker, the scheduler and the router all carry (each service's convert.py calls
these two)."""

from __future__ import annotations

from protos.pagemesh.v1 import generate_pb2
from protos.step import PoolingInfo


def pooling_info_to_pb(info: PoolingInfo) -> generate_pb2.PoolingInfo:
    return generate_pb2.PoolingInfo(
        task=info.task, pooling_type=info.pooling_type, normalize=info.normalize,
        embedding_size=info.embedding_size,
        matryoshka_dimensions=list(info.matryoshka_dimensions),
        any_dimensions=info.any_dimensions, image_tokens=info.image_tokens,
        max_text_tokens=info.max_text_tokens)


def pooling_info_from_pb(pb: generate_pb2.PoolingInfo) -> PoolingInfo:
    """An unset message (an older peer) is a generating model."""
    return PoolingInfo(
        task=pb.task or "generate", pooling_type=pb.pooling_type, normalize=pb.normalize,
        embedding_size=pb.embedding_size,
        matryoshka_dimensions=tuple(pb.matryoshka_dimensions),
        any_dimensions=pb.any_dimensions, image_tokens=pb.image_tokens,
        max_text_tokens=pb.max_text_tokens)
