"""`AsyncClient`: `Client`'s API on asyncio (grpc.aio); `stream` is an async iterator.

    async with AsyncClient("127.0.0.1:50051") as client:
        completion = await client.generate("The capital of France is", max_tokens=8)
        async for chunk in client.stream("Once upon a time", max_tokens=64):
            print(chunk.text, end="", flush=True)

Resumes work as `Client`'s (pagemesh/api/sdk/resume.py drives both).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Self

import grpc

from pagemesh.api.sampling_params import SamplingParams
from pagemesh.api.sdk import errors
from pagemesh.api.sdk.common import (
    CHANNEL_OPTIONS,
    DEFAULT_ADDRESS,
    ClientConfig,
    EmbedInputs,
    Images,
    Message,
    Prompt,
    build_embed_request,
    build_request,
    chat_text,
)
from pagemesh.api.sdk.resume import StreamState
from pagemesh.api.sdk.types import Chunk, Completion, Embeddings, ModelInfo, TokenizeResult
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc


class AsyncClient:
    """`Client` on asyncio; the same arguments (see pagemesh/api/sdk/client.py). Channels are
    made on first use, in the running event loop; use one AsyncClient per loop."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        api_key: str | None = None,
        tls: TlsConfig | None = None,
        ca_path: str | None = None,
        cert_path: str | None = None,
        key_path: str | None = None,
        timeout_s: float | None = None,
        resume_timeout_s: float = 60.0,
        max_resumes: int | None = None,
    ) -> None:
        self.config = ClientConfig.build(
            address,
            api_key=api_key,
            tls=tls,
            ca_path=ca_path,
            cert_path=cert_path,
            key_path=key_path,
            timeout_s=timeout_s,
            resume_timeout_s=resume_timeout_s,
            max_resumes=max_resumes,
        )
        self._channels: dict[int, grpc.aio.Channel] = {}
        self._turns = itertools.count()

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        priority: int = 0,
        images: Images | None = None,
        **overrides: Any,
    ) -> Completion:
        stream = self.stream(
            prompt,
            sampling_params,
            request_id=request_id,
            model=model,
            priority=priority,
            images=images,
            **overrides,
        )
        return await stream.collect()

    def stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        priority: int = 0,
        images: Images | None = None,
        **overrides: Any,
    ) -> AsyncCompletionStream:
        request = build_request(
            prompt,
            sampling_params,
            overrides,
            request_id=request_id,
            model=model,
            priority=priority,
            images=images,
        )
        return self._open(request)

    async def chat(
        self,
        messages: str | Sequence[Message],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> Completion:
        return await self.chat_stream(messages, sampling_params, **kwargs).collect()

    def chat_stream(
        self,
        messages: str | Sequence[Message],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        model: str | None = None,
        priority: int = 0,
        images: Images | None = None,
        **overrides: Any,
    ) -> AsyncCompletionStream:
        request = build_request(
            chat_text(messages),
            sampling_params,
            overrides,
            chat=True,
            request_id=request_id,
            model=model,
            priority=priority,
            images=images,
        )
        return self._open(request)

    def resume(self, request_id: str, resume_from: int, *, n: int = 1) -> AsyncCompletionStream:
        """The rest of a stream begun elsewhere (another process, or before this one
        restarted): what follows the first `resume_from` tokens of each of its `n` samples,
        resumed again if it breaks. NotFound when the request has no checkpoint (it finished
        and was delivered, or its resume window passed)."""
        if resume_from < 0:
            raise errors.InvalidArgument(f"resume_from must be >= 0, got {resume_from}")
        state = StreamState.resuming(
            request_id,
            resume_from,
            n,
            self.config.policy,
            num_addresses=len(self.config.addresses),
            first_address=next(self._turns),
            deadline=self._deadline(),
            clock=time.monotonic,
        )
        return AsyncCompletionStream(self, state)

    async def tokenize(self, text: str, *, chat: bool = False) -> TokenizeResult:
        request = generate_pb2.TokenizeRequest(text=text, apply_chat_template=chat)
        response = await self._unary("Tokenize", request)
        return TokenizeResult(list(response.token_ids), list(response.tokens))

    async def embed(self, inputs: EmbedInputs, *, dimensions: int | None = None) -> Embeddings:
        """One vector per input of an embedding model (see `Client.embed`)."""
        return Embeddings.from_pb(
            await self._unary("Embed", build_embed_request(inputs, dimensions))
        )

    async def model_info(self) -> ModelInfo:
        return ModelInfo.from_pb(
            await self._unary("GetModelInfo", generate_pb2.GetModelInfoRequest())
        )

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _stub(self, index: int) -> generate_pb2_grpc.GenerationStub:
        channel = self._channels.get(index)
        if channel is None:
            channel = self.config.tls.aio_channel(self.config.addresses[index], CHANNEL_OPTIONS)
            self._channels[index] = channel
        return generate_pb2_grpc.GenerationStub(channel)

    def _deadline(self) -> float | None:
        return None if self.config.timeout_s is None else time.monotonic() + self.config.timeout_s

    def _open(self, request: generate_pb2.GenerateRequest) -> AsyncCompletionStream:
        state = StreamState(
            request,
            self.config.policy,
            num_addresses=len(self.config.addresses),
            first_address=next(self._turns),
            deadline=self._deadline(),
            clock=time.monotonic,
        )
        return AsyncCompletionStream(self, state)

    async def _unary(self, method: str, request: Any) -> Any:
        first = next(self._turns)
        num_addresses = len(self.config.addresses)
        for attempt in range(num_addresses):
            stub = self._stub((first + attempt) % num_addresses)
            try:
                return await getattr(stub, method)(
                    request, metadata=self.config.metadata(), timeout=self.config.timeout_s
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == num_addresses - 1:
                    raise errors.from_rpc_error(exc) from None
        raise AssertionError("unreachable")


class AsyncCompletionStream:
    """An async iterator of `Chunk`s of one request (see `CompletionStream`). `aclose()`
    (or leaving an `async with` block) cancels the request."""

    def __init__(self, client: AsyncClient, state: StreamState) -> None:
        self._client = client
        self._state = state
        self._chunks = self._run()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def num_resumes(self) -> int:
        return self._state.num_resumes

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def collect(self) -> Completion:
        completion = Completion.empty(self.request_id, self._state.request.n)
        async with self:
            async for chunk in self._chunks:
                completion.add(chunk)
        completion.num_resumes = self.num_resumes
        return completion

    async def _run(self) -> AsyncGenerator[Chunk, None]:
        state = self._state
        metadata = self._client.config.metadata()
        while True:
            call = self._client._stub(state.address_index).Generate(
                state.next_request(), metadata=metadata, timeout=state.remaining_s()
            )
            failure: tuple[grpc.StatusCode | None, str] = (None, "")  # an early clean end
            try:
                async for response in call:
                    chunk = state.accept(response)
                    if chunk is not None:
                        yield chunk
                if state.complete:
                    return
            except grpc.aio.AioRpcError as exc:
                failure = (exc.code(), exc.details() or "")
            finally:
                call.cancel()  # no-op once ended; frees the router's work when the caller stops
            await asyncio.sleep(state.failed(*failure))
