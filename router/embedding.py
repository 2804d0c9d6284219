"""Embedding requests: inputs in (texts or token ids), one pooled vector per input out.

Each input is its own scheduler request (prefill only: the engine group pools the prompt's
hidden states when its last chunk is computed and frees its KV blocks), sent through the
same dispatcher as a generation, so it is routed across replicas and retried on another
group when one fails. Nothing is checkpointed: a failed input is recomputed whole.
All inputs of a request are checked before any is scheduled.
"""

from __future__ import annotations

import array
import asyncio
import dataclasses
import sys
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from pagemesh.api.options.validation import SamplingOptions, StoppingOptions
from pagemesh.runtime.images import ImageError, ImageLimits, load_image
from pagemesh.runtime.media import RemoteImage
from pagemesh.runtime.serving import ServiceError, invalid_argument
from router.types import SampleOutput, Submission

if TYPE_CHECKING:
    from router.generation import Generation

# OpenAI's limit on inputs of one embeddings request.
MAX_EMBED_INPUTS = 2048
tracer = trace.get_tracer(__name__)


@dataclass(frozen=True)
class EmbeddingRequest:
    """What a client asks to embed: each input a text, token ids, an encoded image (bytes,
    for a model that embeds images), or None (not given)."""

    inputs: list[str | list[int] | bytes | RemoteImage | None]  # a RemoteImage is fetched
    model: str = ""  # "" = the served model
    dimensions: int = 0  # Matryoshka: the first `dimensions` components; 0 = full
    priority: int = 0
    owner: str = ""  # the API key's fingerprint (router/tenancy.py), "" with keys off


@dataclass(frozen=True)
class EmbeddingResult:
    request_id: str
    embeddings: list[bytes]  # per input, in order: float32 little-endian
    num_prompt_tokens: int  # over all inputs
    num_tokens: list[int] = field(default_factory=list)  # per input

    def vectors(self) -> list[array.array]:
        """Each embedding as an array of Python floats (float32 values)."""
        out = []
        for data in self.embeddings:
            values = array.array("f")
            values.frombytes(data)
            if sys.byteorder == "big":
                values.byteswap()
            out.append(values)
        return out


class Embeddings:
    """The router's embedding path, beside `Generation` (whose tokenizer, dispatcher,
    admission slots and model info it shares)."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """INVALID_ARGUMENT before anything is scheduled for: a model that does not embed,
        an unknown model name, no inputs or too many, an empty input, ids outside the
        vocabulary, an input past the context, unsupported `dimensions`."""
        generation = self.generation
        metrics = generation.metrics
        with generation._admitted(request.owner):
            with tracer.start_as_current_span("Embed") as span:
                start_s = time.monotonic()
                request = dataclasses.replace(
                    request, inputs=await generation.fetch_images(request.inputs, "input")
                )
                token_ids = await self._validate(request)
                model = (await generation.directory.model_info()).model
                mesh_id = generation.tenancy.mesh_request_id(request.owner, uuid.uuid4().hex)
                span.set_attribute("gen_ai.operation.name", "embeddings")
                span.set_attribute("gen_ai.request.model", model)
                span.set_attribute("pagemesh.request_id", mesh_id)
                span.set_attribute("gen_ai.usage.input_tokens", sum(map(len, token_ids)))
                outcome = "error"
                try:
                    vectors = await _all_or_none(
                        [
                            self._one(f"{mesh_id}-{i}", ids, item, request)
                            for i, (ids, item) in enumerate(zip(token_ids, request.inputs))
                        ]
                    )
                    outcome = "ok"
                finally:
                    metrics.embedding_inputs.labels(model, outcome).inc(len(token_ids))
                metrics.embedding_tokens.labels(model).inc(sum(map(len, token_ids)))
                metrics.embedding_latency.labels(model).observe(time.monotonic() - start_s)
        return EmbeddingResult(
            mesh_id, vectors, sum(map(len, token_ids)), [len(ids) for ids in token_ids]
        )

    async def _one(
        self, request_id: str, token_ids: list[int], item: object, request: EmbeddingRequest
    ) -> bytes:
        submission = Submission(
            request_id,
            token_ids,
            SamplingOptions(seed=0),
            StoppingOptions(max_tokens=1),
            priority=request.priority,
            owner=request.owner,
            embed_dimensions=request.dimensions,
            embed_image=item if isinstance(item, bytes) else b"",
        )
        vector: list[bytes] = []

        def process(output: SampleOutput) -> None:
            if output.embedding is not None:
                vector.append(output.embedding)

        span = trace.get_current_span()  # Embed's: each input's scheduler span is its child
        async for _ in self.generation.dispatcher.stream(submission, process, span=span):
            pass
        if not vector:
            raise invalid_argument(f"input {request_id} ended without an embedding")
        return vector[-1]

    async def _validate(self, request: EmbeddingRequest) -> list[list[int]]:
        info = await self.generation.directory.model_info()
        if request.model and request.model != info.model:
            raise invalid_argument(
                f"model {request.model!r} is not served here; this router serves {info.model!r}"
            )
        if not info.pooling.embeds:
            raise invalid_argument(
                f"model {info.model!r} generates text; it does not embed: serve an embedding "
                "model, or start this one with --task embed"
            )
        problem = info.pooling.dimensions_error(request.dimensions)
        if problem is not None:
            raise invalid_argument(problem)
        if not request.inputs:
            raise invalid_argument("input is empty: send at least one text or list of token ids")
        if len(request.inputs) > MAX_EMBED_INPUTS:
            raise invalid_argument(
                f"{len(request.inputs)} inputs in one request; at most "
                f"{MAX_EMBED_INPUTS} are accepted: split it"
            )
        max_tokens = await self.generation._max_prompt_tokens()
        if info.pooling.max_text_tokens:
            max_tokens = min(max_tokens, info.pooling.max_text_tokens)
        token_ids = []
        for index, item in enumerate(request.inputs):
            if isinstance(item, bytes):
                ids = await _image_placeholder(
                    index,
                    item,
                    info.pooling.image_tokens,
                    info.model,
                    self.generation.limits.images,
                )
            else:
                ids = await self._tokens(index, item, max_tokens, info.vocab_size)
                if len(ids) > max_tokens:
                    raise invalid_argument(
                        f"input {index} is {len(ids)} tokens but at most {max_tokens} are "
                        "accepted (the model's text limit or context, or --max-prompt-tokens); "
                        "shorten it"
                    )
            token_ids.append(ids)
        return token_ids

    async def _tokens(
        self, index: int, item: str | list[int] | None, max_tokens: int, vocab_size: int
    ) -> list[int]:
        if item is None or len(item) == 0:
            raise invalid_argument(f"input {index} is empty: send at least one character or token")
        if isinstance(item, str):
            try:
                return await self.generation._tokenize(item, False, max_tokens)
            except ServiceError as exc:
                raise ServiceError(exc.code, f"input {index}: {exc.message}") from None
        bad = next((t for t in item if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid_argument(
                f"input {index}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
            )
        return list(item)


async def _all_or_none(calls: list[Coroutine[Any, Any, bytes]]) -> list[bytes]:
    """Every call's result, in order; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _image_placeholder(
    index: int, data: bytes, image_tokens: int, model: str, limits: ImageLimits
) -> list[int]:
    """An image input's prompt: `image_tokens` placeholder ids (its cost in the step
    budget), once the image is known to decode within the limits (off the event loop)."""
    if not image_tokens:
        raise invalid_argument(f"input {index} is an image, but model {model!r} embeds text only")
    if not data:
        raise invalid_argument(f"input {index} is an empty image")
    try:
        await asyncio.to_thread(load_image, data, limits)
    except ImageError as exc:
        raise invalid_argument(f"input {index}: {exc}") from None
    return [0] * image_tokens
