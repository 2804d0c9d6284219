"""The public `Generation` service: validate, tokenize, route, detokenize, stop strings."""

from __future__ import annotations

import contextlib
import logging
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from pagemesh.logs import request_id_var
from pagemesh.serving import ServiceError, invalid_argument
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc
from router import convert
from router.detokenizer import IncrementalDetokenizer
from router.scheduler_client import SchedulerPool
from router.stop import StopChecker
from router.tokenizer import Tokenizer, TokenizerError
from router.validation import ValidatedRequest, ValidationError, validate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdmissionLimits:
    max_queued_requests: int = 1024  # Generate calls in flight through this router
    max_prompt_tokens: int = 0  # 0 = up to the model's context

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_prompt_tokens < 0:
            raise ValueError(f"max_prompt_tokens must be >= 0, got {self.max_prompt_tokens}")


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, pool: SchedulerPool,
                 limits: AdmissionLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.pool = pool
        self.limits = limits or AdmissionLimits()
        self.num_in_flight = 0
        self._seeds = random.SystemRandom()

    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> generate_pb2.GetModelInfoResponse:
        info = generate_pb2.GetModelInfoResponse()
        info.CopyFrom(await self.pool.model_info())
        info.layout.num_replicas = self.pool.num_groups
        return info

    async def Tokenize(self, request: generate_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> generate_pb2.TokenizeResponse:
        token_ids = self._tokenize(request.text, request.apply_chat_template)
        return convert.tokenize_response(token_ids, self.tokenizer.convert_ids_to_tokens(token_ids))

    async def Generate(self, request: generate_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[generate_pb2.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        request_id_var.set(request_id)
        if self.num_in_flight >= self.limits.max_queued_requests:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this router already has {self.num_in_flight} requests in flight "
                f"(--max-queued-requests {self.limits.max_queued_requests}); retry later",
            )
        self.num_in_flight += 1
        try:
            # Closing this stream must close the inner one at once: that cancels the scheduler call.
            async with contextlib.aclosing(self._generate(request_id, request)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.num_in_flight -= 1

    async def _generate(self, request_id: str, request: generate_pb2.GenerateRequest
                        ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        validated = await self._validate(request)
        submit = convert.submit_request(request_id, validated, self._seeds.getrandbits(63))
        samples = [_SampleStream(self.tokenizer, validated) for _ in range(validated.n)]
        num_prompt_tokens = len(validated.prompt_token_ids)
        async with contextlib.aclosing(self.pool.submit(submit)) as chunks:
            async for chunk in chunks:
                sample = samples[chunk.index]
                if sample.finished:
                    continue  # a stop string ended this sample here; the rest is dropped
                token_ids, text, finish_reason, logprobs = sample.process(chunk)
                done = all(s.finished for s in samples)
                num_completion_tokens = sum(s.num_completion_tokens for s in samples)
                yield convert.generate_response(
                    request_id, chunk.index, token_ids, text, logprobs, finish_reason,
                    num_prompt_tokens if done else 0, num_completion_tokens,
                )
                if done:
                    break  # closing `chunks` cancels the scheduler call when a stop string hit

    async def _validate(self, request: generate_pb2.GenerateRequest) -> ValidatedRequest:
        prompt = request.WhichOneof("prompt")
        if prompt is None:
            raise invalid_argument("the request has no prompt: set `text` or `token_ids`")
        if prompt == "text":
            prompt_ids = self._tokenize(request.text, request.apply_chat_template)
        elif request.apply_chat_template:
            raise invalid_argument("apply_chat_template needs a `text` prompt, not `token_ids`")
        else:
            prompt_ids = list(request.token_ids.ids)
        max_prompt_tokens = self.limits.max_prompt_tokens
        if max_prompt_tokens and len(prompt_ids) > max_prompt_tokens:
            raise invalid_argument(
                f"prompt has {len(prompt_ids)} tokens but this router accepts at most "
                f"{max_prompt_tokens} (--max-prompt-tokens); shorten the prompt"
            )
        limits = convert.limits_from_pb(await self.pool.model_info())
        try:
            return validate(
                prompt_ids,
                convert.sampling_from_pb(request.sampling),
                convert.stopping_from_pb(request.stopping),
                request.logprobs or None,
                request.model,
                limits,
                n=request.n or 1,
                priority=request.priority,
            )
        except ValidationError as exc:
            raise invalid_argument(str(exc)) from exc

    def _tokenize(self, text: str, apply_chat_template: bool) -> list[int]:
        if not text:
            raise invalid_argument("the prompt is empty: send at least one character or token")
        try:
            if apply_chat_template:
                return self.tokenizer.apply_chat_template(text)
            return self.tokenizer.encode(text)
        except TokenizerError as exc:
            raise invalid_argument(str(exc)) from exc


class _SampleStream:
    """One sample's text: incremental detokenization, stop strings, token count."""

    def __init__(self, tokenizer: Tokenizer, validated: ValidatedRequest) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, validated.prompt_token_ids)
        self.stop = StopChecker(validated.stopping.stop)
        self.num_completion_tokens = 0
        self.finished = False

    def process(self, chunk: Any) -> tuple[list[int], str, int, list[generate_pb2.TokenLogprob]]:
        """(new token ids, new text, finish reason, logprobs) of one scheduler message."""
        token_ids = list(chunk.token_ids)
        self.num_completion_tokens += len(token_ids)
        finish_reason = chunk.finish_reason
        text, stopped = self.stop.feed(self.detokenizer.add(token_ids))
        if not stopped and finish_reason != convert.FINISH_REASON_UNSPECIFIED:
            tail, stopped = self.stop.feed(self.detokenizer.flush())
            text += tail
            if not stopped:
                text += self.stop.flush()
        if stopped:
            finish_reason = convert.FINISH_REASON_STOP
        self.finished = finish_reason != convert.FINISH_REASON_UNSPECIFIED
        logprobs = convert.token_logprobs(chunk, self._token_texts(chunk)) if chunk.logprobs else []
        return token_ids, text, finish_reason, logprobs

    def _token_texts(self, chunk: Any) -> dict[int, str]:
        ids = {t.token_id for lp in chunk.logprobs for t in lp.top}
        ids.update(chunk.token_ids)
        return {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}
