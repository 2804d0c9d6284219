"""The router's data plane, `Generation`: admit, validate, tokenize, route, detokenize, stop
strings — on router/types.py's domain types, with no protocol in sight. The gRPC servicer
(router/servicer.py) and the OpenAI HTTP API (router/http_api.py) are thin adapters over it,
so both give the same tokens, reject the same requests and trace the same span. Failures are
`ServiceError`s carrying the gRPC status code a caller should see.

Fault tolerance, as the client sees it: a stream never shows a gap or a repeated token.
- An engine group failing mid-stream: `Dispatcher.stream` resumes the request elsewhere
  (router/resume.py); this module never sees the failure.
- This router dying: the client sends the same request_id with `resume_from` (one count
  for every sample, or over HTTP one per choice) to any router, which continues from the
  request's checkpoint (router/replay.py).
- Checkpoint lifetime: once the final chunk (every sample finished, a stop string too) has
  been yielded, the checkpoint is deleted in the background. A client that goes away does not
  delete it: it expires by itself after the resume window, and until then the client can resume.

Here: admission (`AdmissionLimits`, one slot per request in flight), the stream and beam
search; `Generation` inherits its inputs' checks from router/prompt_validation.py and its
checkpoints' lookups and deletes from router/checkpoint_lifetime.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from pagemesh.api.options.validation import ValidationError, check_identity
from pagemesh.runtime.images import DEFAULT_LIMITS, ImageLimits
from pagemesh.runtime.logs import request_id_var
from pagemesh.runtime.media import MediaFetcher
from pagemesh.runtime.metrics_router import ABORT, ERROR, RouterMetrics
from pagemesh.runtime.serving import ServiceError, invalid_argument
from pagemesh.runtime.tokenizer import Tokenizer
from router import replay
from router.beam import beam_search, check_beam_request
from router.checkpoint_lifetime import CheckpointLifetime
from router.client_stream import ClientStream
from router.dispatcher import Dispatcher
from router.embedding import EmbeddingRequest, EmbeddingResult, Embeddings
from router.prompt_validation import PromptValidation
from router.structured import GrammarCompiler
from router.tenancy import Tenancy, request_digest
from router.tracing import describe_request, identify_request, traced_generate
from router.types import GenerationRequest, ModelInfo, Submission, TokenChunk

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = 1024  # generations in flight through this router
    max_prompt_tokens: int = 0  # 0 = up to the model's context
    # Tokens coalesced per client message (vLLM's --stream-interval): 1 streams each token
    # as it comes; N sends every N tokens of a sample (and its end) in one message.
    stream_interval: int = 1
    # Generations in flight per API key (0 = no per-key limit; keys off: not applied), so that
    # one tenant cannot take every slot of --max-queued-requests.
    max_requests_per_key: int = 0
    # What one request's images may be: bytes and pixels each, how many.
    images: ImageLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")
        if self.max_requests_per_key < 0:
            raise ValueError(f"max_requests_per_key must be >= 0, got {self.max_requests_per_key}")


class Generation(PromptValidation, CheckpointLifetime):
    def __init__(
        self,
        tokenizer: Tokenizer,
        dispatcher: Dispatcher,
        limits: AdmissionLimits | None = None,
        metrics: RouterMetrics | None = None,
        tenancy: Tenancy | None = None,
        media: MediaFetcher | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Images given by http(s) URL: fetched from --allowed-media-domains only (none: off).
        self.media = media or MediaFetcher()
        # Request ids scoped per API key (router/tenancy.py); the default's secret is this
        # router's alone, for a router that is the only one (tests, the offline engine).
        self.tenancy = tenancy or Tenancy(uuid.uuid4().bytes + uuid.uuid4().bytes)
        self.grammars = GrammarCompiler(tokenizer)  # structured output (router/structured.py)
        self.dispatcher = dispatcher
        self.directory = dispatcher.directory  # model info, ready groups, the registry
        self.checkpoints = self.directory.registry.checkpoints
        self.limits = limits or AdmissionLimits()
        self.num_in_flight = 0
        self._in_flight_per_owner: collections.Counter[str] = collections.Counter()
        self.metrics = metrics or RouterMetrics()
        self._seeds = random.SystemRandom()
        self._to_delete: list[tuple[str, str | None]] = []  # checkpoints of ended requests
        self._store_away_until = 0.0  # loop time: until then, no lookup for a new request
        self._deleter: asyncio.Task[None] | None = None
        self.embeddings = Embeddings(self)  # the embedding path (router/embedding.py)

    async def model_info(self) -> ModelInfo:
        return await self.directory.model_info()

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """One vector per input of an embedding model (router/embedding.py)."""
        return await self.embeddings.embed(request)

    @contextlib.contextmanager
    def _admitted(self, owner: str) -> Iterator[None]:
        """One slot of --max-queued-requests, and of --max-requests-per-key for `owner`
        (with keys on), held meanwhile; RESOURCE_EXHAUSTED when there is none free."""
        if self.num_in_flight >= self.limits.max_queued_requests:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this router already has {self.num_in_flight} requests in flight "
                f"(--max-queued-requests {self.limits.max_queued_requests}); retry later",
            )
        per_key = self.limits.max_requests_per_key
        if owner and per_key and self._in_flight_per_owner[owner] >= per_key:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this API key already has {self._in_flight_per_owner[owner]} requests in "
                f"flight (--max-requests-per-key {per_key}); retry when one has finished",
            )
        self.num_in_flight += 1
        self._in_flight_per_owner[owner] += 1
        try:
            yield
        finally:
            self.num_in_flight -= 1
            self._in_flight_per_owner[owner] -= 1
            if not self._in_flight_per_owner[owner]:
                del self._in_flight_per_owner[owner]

    @traced_generate  # the request's span, router/tracing.py
    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[TokenChunk]]:
        """The client's chunks, one list per scheduler step (router/client_stream.py).
        RESOURCE_EXHAUSTED past --max-queued-requests; closing the stream cancels the request."""
        try:
            check_identity(request.request_id, request.resume_from, request.n)
        except ValidationError as exc:
            raise invalid_argument(str(exc)) from exc
        request_id = request.request_id or uuid.uuid4().hex  # the client's name for it
        mesh_id = self.tenancy.mesh_request_id(request.owner, request_id)  # the mesh's
        request_id_var.set(mesh_id)
        identify_request(mesh_id)
        with self._admitted(request.owner):
            timer = self.metrics.request(lambda: self.directory.model_name, request.n)
            try:
                # Closing this stream must close the inner one at once: that cancels the
                # scheduler call.
                run = self._beam if request.beam is not None else self._generate
                async with contextlib.aclosing(run(request_id, mesh_id, request)) as batches:
                    async for batch in batches:
                        for chunk in batch:
                            timer.observe(
                                chunk.index,
                                len(chunk.token_ids),
                                chunk.finish_reason,
                                chunk.usage.num_prompt_tokens if chunk.usage else 0,
                            )
                        yield batch
            except (asyncio.CancelledError, GeneratorExit):  # the client went away
                timer.end(ABORT)
                raise
            except Exception:
                timer.end(ERROR)
                raise

    async def _generate(
        self, request_id: str, mesh_id: str, request: GenerationRequest
    ) -> AsyncIterator[list[TokenChunk]]:
        """`request_id` is the client's name for the request (its chunks carry it);
        `mesh_id` the mesh's (the scheduler, the checkpoint, logs and spans carry it)."""
        digest = request_digest(request)
        plan = await self._resume_plan(request_id, mesh_id, request, digest)
        if plan is None:
            lora_name = await self._adapter(request.model)
            if lora_name:  # the adapter's name is the model the client asked for
                request = dataclasses.replace(request, model="")
            validated, images = await self._validate(request)
            submission = Submission.fresh(
                mesh_id, validated, self._seeds.getrandbits(63), request.owner, digest
            )
            if images or lora_name:
                submission = dataclasses.replace(submission, images=images, lora_name=lora_name)
            plan = replay.fresh(self.tokenizer, submission)
        progress = plan.progress
        span = trace.get_current_span()  # generate's (router/tracing.py), or a no-op one
        if span.is_recording():
            describe_request(
                span,
                plan.submission,
                progress.resumed,
                request.model,
                (await self.directory.model_info()).model,
            )
        client = ClientStream(request_id, plan, self.limits.stream_interval)
        replayed = [c for output in plan.replay if (c := client.process(output)) is not None]
        if replayed:
            yield replayed
        if not client.done:
            # Closing `batches` cancels the scheduler call (when a stop string hit, say).
            try:
                async with contextlib.aclosing(
                    self.dispatcher.stream(plan.submission, client.process, progress, span)
                ) as batches:
                    async for batch in batches:
                        yield batch
            except ServiceError as exc:
                if exc.code != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                # Said with the client's id: the mesh's is nothing the client knows.
                raise ServiceError(
                    exc.code,
                    f"request {request_id!r} is already streaming: wait "
                    "for its end, cancel it, or send this one under another id",
                ) from None
        if client.done:
            # The client has everything: its checkpoint is garbage now.
            self._forget_checkpoint(mesh_id, progress.groups, client.cut_short)

    async def _beam(
        self, request_id: str, mesh_id: str, request: GenerationRequest
    ) -> AsyncIterator[list[TokenChunk]]:
        """`use_beam_search` (router/beam.py): rounds of one-token requests, each through
        `_generate`; the `n` best beams at the end. `mesh_id` names no mesh request: each
        round's requests have their own."""
        check_beam_request(request)
        validated, _ = await self._validate(dataclasses.replace(request, beam=None, n=1))
        limits = (await self.directory.model_info()).limits()
        yield await beam_search(
            request,
            validated.prompt_token_ids,
            limits.eos_token_ids,
            validated.max_tokens,
            self._generate,
            self.tokenizer.decode,
            request_id,
            lambda sub_id: self.tenancy.mesh_request_id(request.owner, sub_id),
        )

    async def _adapter(self, model: str) -> str:
        """The LoRA adapter `model` names ("" for the base model, or no model given);
        NOT_FOUND naming what is served when it is neither."""
        info = await self.directory.model_info()
        if not model or model == info.model:
            return ""
        adapters = self.directory.adapters
        if model in adapters:
            return model
        raise ServiceError(
            grpc.StatusCode.NOT_FOUND,
            f"model {model!r} is not served here: the base model is {info.model!r}, and the "
            f"LoRA adapters are {', '.join(sorted(adapters)) or 'none'}",
            reason="model_not_found",
        )
