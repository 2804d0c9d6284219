"""`Client`: a running mesh from Python, over the router's public gRPC API
(`pagemesh.v1.Generation`), blocking.

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8).text)
        for chunk in client.stream("Once upon a time", max_tokens=64, temperature=0.8):
            print(chunk.text, end="", flush=True)

A stream whose router dies (or whose connection drops) is resumed on the next router
address, or the same one once it is back, by request id: the caller sees every token once
(pagemesh/api/sdk/resume.py). `AsyncClient` (pagemesh/api/sdk/aio.py) is the same API on asyncio.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Generator, Iterator, Sequence
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


class Client:
    """A client of one mesh's routers (any of `address`, if several; new requests take turns).

    - api_key: sent as `authorization: Bearer <key>` (routers started with --api-key);
    - tls, or ca_path / cert_path / key_path: dial TLS (with a CA), mutual TLS (with a
      certificate and key too); plaintext without a CA;
    - timeout_s: bound on each call, resumes included; None = none;
    - resume_timeout_s: how long a broken stream keeps trying to resume without a new chunk;
    - max_resumes: resumes per request (None = bounded by resume_timeout_s only; 0 = never).
    """

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
        self._channels: dict[int, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._turns = itertools.count()

    # --- generation ---------------------------------------------------------------------

    def generate(
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
        """Generates to the end and returns every sample. `prompt`: text or token ids;
        `overrides`: `SamplingParams` fields (e.g. `max_tokens=32, temperature=0`);
        `images`: a vision-language model's, one per image token in the prompt (e.g.
        `<image>`), in order: encoded bytes (PNG, JPEG, WebP, GIF) or PIL images."""
        stream = self.stream(
            prompt,
            sampling_params,
            request_id=request_id,
            model=model,
            priority=priority,
            images=images,
            **overrides,
        )
        return stream.collect()

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
    ) -> CompletionStream:
        """The request's output as it is generated: an iterator of `Chunk`s, each sample's
        new tokens and text, each exactly once even across router failures."""
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

    def chat(
        self,
        messages: str | Sequence[Message],
        sampling_params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> Completion:
        """`generate` on one user message put through the model's chat template (the gRPC
        API takes one; see `common.chat_text` for conversations)."""
        return self.chat_stream(messages, sampling_params, **kwargs).collect()

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
    ) -> CompletionStream:
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

    # --- other calls ----------------------------------------------------------------------

    def resume(self, request_id: str, resume_from: int, *, n: int = 1) -> CompletionStream:
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
        return CompletionStream(self, state)

    def tokenize(self, text: str, *, chat: bool = False) -> TokenizeResult:
        """The served model's token ids of `text` (`chat`: as one user message through the
        chat template)."""
        request = generate_pb2.TokenizeRequest(text=text, apply_chat_template=chat)
        response = self._unary("Tokenize", request)
        return TokenizeResult(list(response.token_ids), list(response.tokens))

    def embed(self, inputs: EmbedInputs, *, dimensions: int | None = None) -> Embeddings:
        """One vector per input of an embedding model (a text, a list of token ids, or a
        list of either), in input order; `dimensions` for Matryoshka models. Idempotent:
        retried on another router address when one is down."""
        return Embeddings.from_pb(self._unary("Embed", build_embed_request(inputs, dimensions)))

    def model_info(self) -> ModelInfo:
        return ModelInfo.from_pb(self._unary("GetModelInfo", generate_pb2.GetModelInfoRequest()))

    # --- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------

    def _stub(self, index: int) -> generate_pb2_grpc.GenerationStub:
        with self._lock:
            channel = self._channels.get(index)
            if channel is None:
                channel = self.config.tls.channel(self.config.addresses[index], CHANNEL_OPTIONS)
                self._channels[index] = channel
        return generate_pb2_grpc.GenerationStub(channel)

    def _deadline(self) -> float | None:
        return None if self.config.timeout_s is None else time.monotonic() + self.config.timeout_s

    def _open(self, request: generate_pb2.GenerateRequest) -> CompletionStream:
        state = StreamState(
            request,
            self.config.policy,
            num_addresses=len(self.config.addresses),
            first_address=next(self._turns),
            deadline=self._deadline(),
            clock=time.monotonic,
        )
        return CompletionStream(self, state)

    def _unary(self, method: str, request: Any) -> Any:
        """One unary call; UNAVAILABLE (a router down) tries each other address once."""
        first = next(self._turns)
        num_addresses = len(self.config.addresses)
        for attempt in range(num_addresses):
            stub = self._stub((first + attempt) % num_addresses)
            try:
                return getattr(stub, method)(
                    request, metadata=self.config.metadata(), timeout=self.config.timeout_s
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == num_addresses - 1:
                    raise errors.from_rpc_error(exc) from None
        raise AssertionError("unreachable")


class CompletionStream:
    """An iterator of `Chunk`s of one request. `request_id` names it (a resume uses it);
    `num_resumes` counts the times its stream broke and was resumed. Closing it (or
    leaving a `with` block, or `close()`) cancels the request."""

    def __init__(self, client: Client, state: StreamState) -> None:
        self._client = client
        self._state = state
        self._chunks = self._run()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def num_resumes(self) -> int:
        return self._state.num_resumes

    def __iter__(self) -> Iterator[Chunk]:
        return self._chunks

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def collect(self) -> Completion:
        """Reads the stream to its end: the finished request."""
        completion = Completion.empty(self.request_id, self._state.request.n)
        with self:
            for chunk in self._chunks:
                completion.add(chunk)
        completion.num_resumes = self.num_resumes
        return completion

    def _run(self) -> Generator[Chunk, None, None]:
        state = self._state
        metadata = self._client.config.metadata()
        while True:
            call = self._client._stub(state.address_index).Generate(
                state.next_request(), metadata=metadata, timeout=state.remaining_s()
            )
            failure: tuple[grpc.StatusCode | None, str] = (None, "")  # an early clean end
            try:
                for response in call:
                    chunk = state.accept(response)
                    if chunk is not None:
                        yield chunk
                if state.complete:
                    return
            except grpc.RpcError as exc:
                failure = (exc.code(), exc.details() or "")
            finally:
                call.cancel()  # no-op once ended; frees the router's work when the caller stops
            time.sleep(state.failed(*failure))
