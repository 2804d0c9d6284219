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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import trace
from redis.exceptions import RedisError

from pagemesh.api.options.constraint import OutputConstraint
from pagemesh.api.options.validation import (
    ModelLimits,
    ValidatedRequest,
    ValidationError,
    check_identity,
    check_unicode,
    validate,
)
from pagemesh.runtime.checkpoints import Checkpoint
from pagemesh.runtime.images import (
    DEFAULT_LIMITS,
    ImageError,
    ImageLimits,
    check_num_images,
    expand_images,
    image_token_count,
    load_image,
)
from pagemesh.runtime.logs import request_id_var
from pagemesh.runtime.media import MediaFetcher, RemoteImage
from pagemesh.runtime.metrics import ABORT, ERROR, RouterMetrics
from pagemesh.runtime.serving import ServiceError, invalid_argument, unavailable
from pagemesh.runtime.tokenizer import Tokenizer, TokenizerError
from protos.step import ImageInput
from router import replay
from router.beam import beam_search, check_beam_request
from router.client_stream import ClientStream
from router.dispatcher import Dispatcher
from router.embedding import EmbeddingRequest, EmbeddingResult, Embeddings
from router.structured import ConstraintError, GrammarCompiler
from router.tenancy import Tenancy, request_digest
from router.tracing import describe_request, identify_request, traced_generate
from router.types import GenerationRequest, ModelInfo, Submission, TokenChunk

logger = logging.getLogger(__name__)

T = TypeVar("T")


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


class Generation:
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

    async def tokenize(
        self, text: str, apply_chat_template: bool, owner: str = ""
    ) -> tuple[list[int], list[str]]:
        """The text's token ids and each one's text piece. INVALID_ARGUMENT for empty text;
        it takes an admission slot meanwhile, as a generation does."""
        with self._admitted(owner):
            token_ids = await self._tokenize(text, apply_chat_template, max_num_tokens=None)
        return token_ids, self.tokenizer.convert_ids_to_tokens(token_ids)

    async def tokenize_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        owner: str = "",
    ) -> list[int]:
        """Token ids of chat `messages` through the model's template (the OpenAI chat API's
        prompt), with the `tools` it shows the model. INVALID_ARGUMENT when the template
        rejects them, when they are not valid Unicode, or when they cannot fit the model
        whatever they tokenize to (tools included: they are refused by size before any
        rendering). It takes an admission slot meanwhile, as a generation does."""
        texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
        # Tool definitions and calls' arguments reach the template too.
        extra = json.dumps(
            [tools or [], [m.get("tool_calls") for m in messages]], ensure_ascii=False
        )
        if len(extra) > MAX_TOOLS_CHARS:
            raise invalid_argument(
                f"the tools and tool calls are {len(extra):,} characters of JSON; at most "
                f"{MAX_TOOLS_CHARS:,} are accepted: send fewer or shorter tool definitions"
            )
        with self._admitted(owner):
            for text in texts:
                _check_unicode(text, "a message's content")
            _check_unicode(extra, "the tools or tool calls")
            num_chars = sum(map(len, texts))
            await self._check_fits(num_chars, len(messages), await self._max_prompt_tokens())
            render = functools.partial(self.tokenizer.apply_chat_messages, tools=tools)
            try:
                return await _off_loop_if_long(num_chars + len(extra), render, messages)
            except TokenizerError as exc:
                raise invalid_argument(str(exc)) from exc

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

    async def _resume_plan(
        self, request_id: str, mesh_id: str, request: GenerationRequest, digest: str
    ) -> replay.StreamPlan | None:
        """A resume (router/replay.py) when the caller's request has a checkpoint; None for a
        new request. NOT_FOUND for `resume_from` > 0 without a checkpoint; INVALID_ARGUMENT
        when the checkpoint is of another request the caller sent under the same id."""
        resume_from = request.resume_from
        wants_resume = any(resume_from) if isinstance(resume_from, list) else resume_from > 0
        if not request.request_id or request.new_request:
            if wants_resume:
                raise invalid_argument(
                    "resume_from needs the id of the request to resume "
                    "(gRPC: request_id; HTTP: the X-Request-Id header)"
                )
            return None
        loop = asyncio.get_running_loop()
        if not wants_resume and loop.time() < self._store_away_until:
            return None  # Redis just failed a lookup: a new request does not wait on it again
        try:
            # Bounded: a fresh request must not wait on a frozen Redis (a lookup that times
            # out is "no checkpoint" for it, below).
            ckpt = await asyncio.wait_for(self.checkpoints.load(mesh_id), CHECKPOINT_LOOKUP_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self._store_away_until = loop.time() + STORE_AWAY_S
            if wants_resume:
                raise unavailable(
                    f"the checkpoint store is unreachable ({exc}); retry shortly"
                ) from exc
            logger.debug("no checkpoint lookup (%s); a new request", exc)
            return None
        plan = self._plan_from_checkpoint(ckpt, resume_from) if ckpt is not None else None
        if plan is None or plan.submission.owner != request.owner:
            # None, or another key's (a forged record: ids are scoped per key): as unknown.
            if wants_resume:
                raise ServiceError(
                    grpc.StatusCode.NOT_FOUND,
                    f"request {request_id!r} has no checkpoint to resume from: it finished and "
                    "its output was delivered, or it ended long enough ago that its checkpoint "
                    "expired (or the id is wrong); send it again as a new request",
                )
            return None
        stored = plan.submission.request_digest
        if digest and stored and digest != stored:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request id {request_id!r} is already taken by a different request of yours "
                "(its checkpoint is kept for the resume window): send a new request under a "
                "new id, or this id with the same request to resume it",
                reason="id_conflict",
            )
        logger.warning(
            "request %s resumed from its checkpoint (group %s, %s, %s output tokens "
            "per sample) after %s tokens the client has",
            mesh_id,
            ckpt.group,
            ckpt.state,
            [len(s.token_ids) for s in ckpt.samples],
            resume_from,
        )
        if plan.submission.images:
            plan.submission = await self._with_stored_images(request_id, plan.submission)
        return plan

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

    async def _with_stored_images(self, request_id: str, submission: Submission) -> Submission:
        """A checkpoint's submission with its images' bytes, from the image store (the
        record names them by SHA-256). NOT_FOUND when one is no longer there."""
        wanted = [image.sha256 for image in submission.images if not image.data]
        try:
            found = await asyncio.wait_for(self.checkpoints.images.get_many(wanted), IMAGE_LOOKUP_S)
        except (RedisError, OSError, TimeoutError) as exc:
            raise unavailable(f"the image store is unreachable ({exc}); retry shortly") from exc
        lost = [
            i
            for i, image in enumerate(submission.images)
            if not image.data and image.sha256 not in found
        ]
        if lost:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"request {request_id!r} cannot be resumed: its image(s) {lost} (by order in "
                "the prompt) are no longer in the image store (expired with the checkpoint, "
                "or over the schedulers' --image-store-mib); send it again as a new request",
            )
        images = tuple(
            image if image.data else dataclasses.replace(image, data=found[image.sha256])
            for image in submission.images
        )
        return dataclasses.replace(submission, images=images)

    def _plan_from_checkpoint(
        self, ckpt: Checkpoint, resume_from: int | list[int]
    ) -> replay.StreamPlan:
        try:
            return replay.from_checkpoint(self.tokenizer, ckpt, resume_from)
        except ValidationError as exc:  # one count per sample, but not as many as samples
            raise invalid_argument(str(exc)) from exc

    def _forget_checkpoint(self, request_id: str, groups: list[str], cut_short: bool) -> None:
        """Deletes the request's checkpoint in the background, never delaying the client;
        the deletes of every request that ended meanwhile go in one round trip. When the
        router cut the scheduler call short (a stop string), the scheduler may still write
        the checkpoint once more as it notices: delete it again a TTL later."""
        entries = [(request_id, group) for group in groups or [None]]
        self._queue_deletes(entries)
        if cut_short:
            asyncio.get_running_loop().call_later(
                self.directory.ttl_s, self._queue_deletes, entries
            )

    def _queue_deletes(self, entries: list[tuple[str, str | None]]) -> None:
        self._to_delete += entries
        if self._deleter is None:
            self._deleter = asyncio.get_running_loop().create_task(self._delete_checkpoints())

    async def _delete_checkpoints(self) -> None:
        try:
            while self._to_delete:
                entries, self._to_delete = self._to_delete, []
                try:
                    await self.checkpoints.delete_many(entries)
                except Exception as exc:  # they expire by themselves; the poll logs Redis away
                    logger.debug("could not delete %d checkpoints: %s", len(entries), exc)
        finally:
            self._deleter = None

    async def _validate(
        self, request: GenerationRequest
    ) -> tuple[ValidatedRequest, tuple[ImageInput, ...]]:
        info = await self.directory.model_info()
        if info.pooling.embeds:
            raise invalid_argument(
                f"model {info.model!r} is an embedding model: it does not generate text; send "
                "its inputs to /v1/embeddings (gRPC: Embed)"
            )
        prompt = request.prompt
        if prompt is None:
            raise invalid_argument("the request has no prompt: set `text` or `token_ids`")
        if isinstance(prompt, str):
            prompt_ids = await self._tokenize(
                prompt, request.apply_chat_template, await self._max_prompt_tokens()
            )
        elif request.apply_chat_template:
            raise invalid_argument("apply_chat_template needs a `text` prompt, not `token_ids`")
        else:
            prompt_ids = prompt
        images: tuple[ImageInput, ...] = ()
        if request.images:
            prompt_ids, images = await self._with_images(prompt_ids, request.images, info)
        max_prompt_tokens = self.limits.max_prompt_tokens
        if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
            raise invalid_argument(
                f"prompt has {len(prompt_ids)} tokens but this router accepts at most "
                f"{max_prompt_tokens} (--max-prompt-tokens); shorten the prompt"
            )
        limits = (await self.directory.model_info()).limits()
        grammar = await self._compile(request.constraint, limits)
        try:
            validated = validate(
                prompt_ids,
                request.sampling,
                request.stopping,
                request.num_logprobs,
                request.model,
                limits,
                n=request.n,
                priority=request.priority,
                grammar=grammar,
            )
        except ValidationError as exc:
            raise invalid_argument(str(exc)) from exc
        return validated, images

    async def _with_images(
        self, prompt_ids: list[int], images: list[bytes | RemoteImage], info: ModelInfo
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """A vision-language prompt: each image fetched (an http(s) URL) and checked (decoded
        off the event loop, within the size and pixel limits), and each image token expanded
        into its image's placeholders. INVALID_ARGUMENT for images to a text-only model, too
        many, a URL not allowed or not fetched, one that is not an image, or image tokens
        that do not pair up with the images."""
        if not info.image_seq_length:
            raise invalid_argument(f"model {info.model!r} is a text-only model: it takes no images")
        limits = self.limits.images
        try:
            check_num_images(len(images), limits)
        except ImageError as exc:
            raise invalid_argument(str(exc)) from None
        data = await self.fetch_images(images, "image")
        counts = []
        for index, image in enumerate(data):
            try:
                decoded = await asyncio.to_thread(load_image, image, limits)
            except ImageError as exc:
                raise invalid_argument(f"image {index}: {exc}") from None
            counts.append(image_token_count(decoded, info.image_seq_length, info.image_tiling))
        try:
            return expand_images(prompt_ids, data, info.image_token_id, counts)
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None

    async def fetch_images(self, items: list[T], what: str) -> list[T | bytes]:
        """`items` with each RemoteImage replaced by its bytes, fetched at once; the first
        that fails is INVALID_ARGUMENT naming it ("<what> <index>: why")."""
        remote = [(i, item) for i, item in enumerate(items) if isinstance(item, RemoteImage)]
        if not remote:
            return list(items)
        for index, item in remote:  # no I/O before every URL is allowed
            try:
                self.media.check_url(item.url)
            except ImageError as exc:
                raise invalid_argument(f"{what} {index}: {exc}") from None
        fetched = await asyncio.gather(
            *(self.media.fetch(item.url) for _, item in remote), return_exceptions=True
        )
        out: list[T | bytes] = list(items)
        for (index, _), result in zip(remote, fetched):
            if isinstance(result, ImageError):
                raise invalid_argument(f"{what} {index}: {result}") from None
            if isinstance(result, BaseException):
                raise result
            out[index] = result
        return out

    async def _compile(self, constraint: OutputConstraint | None, limits: ModelLimits) -> str:
        """The request's output constraint compiled and checked against the model's
        vocabulary (on a worker thread: the first one builds that view, slowly); "" for none.
        INVALID_ARGUMENT naming what is wrong, before anything is scheduled."""
        if constraint is None:
            return ""
        try:
            return await asyncio.to_thread(
                self.grammars.compile, constraint, limits.vocab_size, limits.eos_token_ids
            )
        except ConstraintError as exc:
            raise invalid_argument(str(exc)) from None

    async def _tokenize(
        self, text: str, apply_chat_template: bool, max_num_tokens: int | None
    ) -> list[int]:
        """`text` tokenized (long texts off the event loop, so that the router keeps answering
        meanwhile); refused before any work when it cannot fit `max_num_tokens`."""
        if not text:
            raise invalid_argument("the prompt is empty: send at least one character or token")
        _check_unicode(text, "the prompt")
        if max_num_tokens is not None:
            await self._check_fits(len(text), 1, max_num_tokens)
        encode = (
            self.tokenizer.apply_chat_template if apply_chat_template else self.tokenizer.encode
        )
        try:
            return await _off_loop_if_long(len(text), encode, text)
        except TokenizerError as exc:
            raise invalid_argument(str(exc)) from exc

    async def _max_prompt_tokens(self) -> int:
        """The most prompt tokens a request may have: the model's context, or less with
        --max-prompt-tokens."""
        max_model_len = (await self.directory.model_info()).limits().max_model_len
        limit = self.limits.max_prompt_tokens
        return min(max_model_len, limit) if limit else max_model_len

    async def _check_fits(self, num_chars: int, num_parts: int, max_num_tokens: int) -> None:
        """Refuses, before tokenizing, text that is too long whatever it tokenizes to."""
        at_least = max(self.tokenizer.min_num_tokens(num_chars), num_parts)
        if at_least > max_num_tokens:
            raise invalid_argument(
                f"the prompt ({num_chars:,} characters in {num_parts:,} part(s)) is at least "
                f"{at_least:,} tokens for this tokenizer, whose longest token is "
                f"{self.tokenizer.max_token_chars} characters, but at most {max_num_tokens:,} "
                "are accepted (the model's context, or --max-prompt-tokens); shorten it"
            )


CHECKPOINT_LOOKUP_S = 0.5  # the longest a request waits for its checkpoint lookup
IMAGE_LOOKUP_S = 5.0  # ... and for a resumed request's images (megabytes, maybe)
STORE_AWAY_S = 2.0  # after a failed lookup, new requests skip theirs this long
OFF_LOOP_CHARS = 16_384
# Characters of JSON of a chat request's tool definitions and calls, checked before the
# template renders them (a 16 MB `tools` list took the router's CPU for seconds).
MAX_TOOLS_CHARS = 1_000_000  # texts longer than this are tokenized on a worker thread


async def _off_loop_if_long(num_chars: int, fn: Callable[[T], list[int]], arg: T) -> list[int]:
    """`fn(arg)` here for short texts (a thread hand-off costs more than they take), on a
    worker thread for long ones: a 16 MB prompt took seconds to tokenize, and a router whose event
    loop stops that long answers nothing, not even its health (and is then restarted as hung)."""
    if num_chars <= OFF_LOOP_CHARS:
        return fn(arg)
    return await asyncio.to_thread(fn, arg)


def _check_unicode(text: str, what: str) -> None:
    try:
        check_unicode(text, what)
    except ValidationError as exc:
        raise invalid_argument(str(exc)) from None
