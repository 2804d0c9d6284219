"""`LLM.embed` and `LLM.encode`: vLLM's offline pooling API on the in-process engine core.

    llm = LLM("path/to/Qwen3-Embedding")  # or any decoder with task="embed"
    for output in llm.embed(["a query", "a passage"]):
        print(len(output.outputs.embedding))

Each prompt is one engine request (prefill only, pooled when its last chunk is computed);
the checks are the router's (router/embedding.py): the same model, prompt and
`dimensions` give the same vector through the mesh.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagemesh.runtime.images import ImageError, load_image
from pagemesh.runtime.media import RemoteImage
from protos.step import PoolingInfo
from protos.step import PoolingParams as StepPoolingParams
from scheduler_svc.core import admission
from scheduler_svc.core.types import Request, RequestEvent


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request pooling settings: `dimensions` (Matryoshka models) keeps the
    first components of the vector (normalised again where the model normalises)."""

    dimensions: int | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's `EmbeddingRequestOutput`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    data: Any  # torch.Tensor [embedding size], float32


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled output, as vLLM's `PoolingRequestOutput` (`LLM.encode`)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


def image_input(prompt: Any, image_tokens: int) -> bytes:
    """A prompt's image (vLLM's `{"prompt": ..., "multi_modal_data": {"image": ...}}`, the
    image a PIL image or encoded bytes) as encoded bytes; b"" for a text prompt. ValueError
    for an image the model cannot take or that does not decode within the limits."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    image = (data or {}).get("image")
    if image is None:
        return b""
    if not image_tokens:
        raise ValueError("this model embeds text only: it takes no multi_modal_data image")
    if isinstance(image, list):
        if len(image) != 1:
            raise ValueError("an embedding is of one image: give one per prompt")
        image = image[0]
    return image_bytes(image)


def image_bytes(image: Any) -> bytes:
    """A PIL image (saved as PNG, lossless) or encoded bytes, checked to decode within the
    limits (ImageError, a ValueError, names what is wrong). An http(s) URL is not fetched
    here: the offline engine takes the image itself."""
    if isinstance(image, RemoteImage):
        raise ImageError(
            f"the offline engine does not fetch image URLs ({image.url}): pass "
            "the image (PIL, bytes or a data: URL); the server fetches URLs from "
            "its --allowed-media-domains"
        )
    if not isinstance(image, (bytes, bytearray)):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        image = buffer.getvalue()
    load_image(bytes(image))
    return bytes(image)


def embedding_requests(
    request_ids: list[str],
    prompts: list[list[int]],
    params: PoolingParams | None,
    pooling: PoolingInfo,
    max_model_len: int,
    images: list[bytes] | None = None,
) -> list[Request]:
    """The engine's requests; ValueError (naming the prompt) for what the router refuses."""
    if not pooling.embeds:
        raise ValueError(
            "this model generates text; it does not embed: load an embedding "
            'model, or this one with task="embed"'
        )
    dimensions = (params.dimensions if params is not None else None) or 0
    problem = pooling.dimensions_error(dimensions)
    if problem is not None:
        raise ValueError(problem)
    requests = []
    images = images or [b""] * len(prompts)
    max_text = min(max_model_len, pooling.max_text_tokens or max_model_len)
    for index, (request_id, token_ids, image) in enumerate(zip(request_ids, prompts, images)):
        if not token_ids:
            raise ValueError(f"prompt {index} is empty: send at least one character or token")
        if not image and len(token_ids) > max_text:
            raise ValueError(
                f"prompt {index} is {len(token_ids)} tokens but at most "
                f"{max_text} are accepted (the model's text limit or "
                "max_model_len); shorten it"
            )
        requests.append(
            admission.core_request(
                admission.RequestSpec(
                    request_id=request_id,
                    prompt_token_ids=token_ids,
                    seed=0,
                    max_tokens=1,
                    pooling=StepPoolingParams(dimensions, image),
                ),
                (),
                0.0,
            )
        )
    return requests


class EmbedSink:
    """The engine loop's sink for one `embed` call (`RequestSink`)."""

    def __init__(
        self, request_ids: list[str], on_request_done: Callable[[], None] | None = None
    ) -> None:
        self.vectors: dict[str, bytes] = {}
        self.error: str | None = None
        self._pending = set(request_ids)
        self._on_request_done = on_request_done
        self._done = threading.Event()
        if not self._pending:
            self._done.set()

    def deliver(self, events: list[RequestEvent]) -> None:
        for event in events:
            if event.embedding is not None:
                self.vectors[event.request_id] = event.embedding
            if event.finish_reason is not None:
                self._pending.discard(event.request_id)
                if self._on_request_done is not None:
                    self._on_request_done()
        if not self._pending:
            self._done.set()

    def fail(self, request_id: str, message: str) -> None:
        self.error = message
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._done.wait(timeout_s)

    def vector(self, request_id: str) -> np.ndarray:
        data = self.vectors.get(request_id)
        if data is None:
            raise RuntimeError(f"request {request_id} ended without an embedding")
        return np.frombuffer(data, dtype="<f4").copy()
