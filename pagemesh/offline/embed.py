"""`LLM.embed` and `LLM.encode`: vLLM's offline pooling API on the in-process engine core.

    llm = LLM("path/to/Qwen3-Embedding")  # or any decoder with task="embed"
    for output in llm.embed(["a query", "a passage"]):
        print(len(output.outputs.embedding))

Each prompt is one engine request (prefill only, pooled when its last chunk is computed);
the checks are the router's (router/embedding.py): the same model, prompt and
`dimensions` give the same vector through the mesh.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from scheduler_svc.core import admission
from scheduler_svc.core.types import Request, RequestEvent
from protos.step import PoolingInfo, PoolingParams as StepPoolingParams


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


def embedding_requests(request_ids: list[str], prompts: list[list[int]],
                       params: PoolingParams | None, pooling: PoolingInfo,
                       max_model_len: int) -> list[Request]:
    """The engine's requests; ValueError (naming the prompt) for what the router refuses."""
    if not pooling.embeds:
        raise ValueError("this model generates text; it does not embed: load an embedding "
                         "model, or this one with task=\"embed\"")
    dimensions = (params.dimensions if params is not None else None) or 0
    problem = pooling.dimensions_error(dimensions)
    if problem is not None:
        raise ValueError(problem)
    requests = []
    for index, (request_id, token_ids) in enumerate(zip(request_ids, prompts)):
        if not token_ids:
            raise ValueError(f"prompt {index} is empty: send at least one character or token")
        if len(token_ids) > max_model_len:
            raise ValueError(f"prompt {index} is {len(token_ids)} tokens but at most "
                             f"{max_model_len} are accepted (max_model_len); shorten it")
        requests.append(admission.core_request(admission.RequestSpec(
            request_id=request_id, prompt_token_ids=token_ids, seed=0, max_tokens=1,
            pooling=StepPoolingParams(dimensions)), (), 0.0))
    return requests


class EmbedSink:
    """The engine loop's sink for one `embed` call (`RequestSink`)."""

    def __init__(self, request_ids: list[str],
                 on_request_done: Callable[[], None] | None = None) -> None:
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
