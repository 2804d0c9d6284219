"""The Python client of a running mesh: `Client` (blocking) and `AsyncClient` (asyncio) over
the router's gRPC API, with streams that resume across router failures, and typed errors.

    from pagemesh.api.sdk import Client
    with Client(["10.0.0.1:50051", "10.0.0.2:50051"], api_key="...") as client:
        for chunk in client.stream("Once upon a time", max_tokens=64):
            print(chunk.text, end="", flush=True)
"""

from pagemesh.api.sdk.aio import AsyncClient, AsyncCompletionStream
from pagemesh.api.sdk.client import Client, CompletionStream
from pagemesh.api.sdk.errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    NotFound,
    PagemeshError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from pagemesh.api.sdk.types import (
    Chunk,
    Completion,
    Embeddings,
    ModelInfo,
    SampleOutput,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "AsyncCompletionStream",
    "Cancelled",
    "Chunk",
    "Client",
    "Completion",
    "CompletionStream",
    "DeadlineExceeded",
    "Embeddings",
    "InternalError",
    "InvalidArgument",
    "ModelInfo",
    "NotFound",
    "PagemeshError",
    "PermissionDenied",
    "ResourceExhausted",
    "SampleOutput",
    "TokenLogprob",
    "TokenizeResult",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
