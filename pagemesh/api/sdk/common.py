"""What the sync and async clients share: their configuration, the channel options, and
how a call's arguments become a `GenerateRequest`."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagemesh.api.sampling_params import SamplingParams, to_generate_request
from pagemesh.api.sdk import errors
from pagemesh.api.sdk.resume import ResumePolicy
from pagemesh.runtime import keepalive
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
# Dial a restarted router again within a second (gRPC's default backoff grows to 120 s),
# and notice a frozen or cut-off router by keepalive within 5 s (pagemesh/runtime/keepalive.py).
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *keepalive.CHANNEL_OPTIONS,
]

Prompt = str | list[int]
Message = Mapping[str, Any]
# A vision-language prompt's images, in the order of its image tokens: encoded bytes (PNG,
# JPEG, WebP, GIF) or PIL images (sent as PNG, lossless).
Images = Sequence[Any]


@dataclass(frozen=True)
class ClientConfig:
    addresses: tuple[str, ...]  # router addresses, host:port; new requests take turns
    api_key: str | None
    tls: TlsConfig  # no CA = plaintext
    timeout_s: float | None  # per call, resumes included; None = none
    policy: ResumePolicy

    def __post_init__(self) -> None:
        if not self.addresses or not all(self.addresses):
            raise ValueError("give at least one router address (host:port)")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")

    @classmethod
    def build(
        cls,
        address: str | Sequence[str],
        *,
        api_key: str | None,
        tls: TlsConfig | None,
        ca_path: str | None,
        cert_path: str | None,
        key_path: str | None,
        timeout_s: float | None,
        resume_timeout_s: float,
        max_resumes: int | None,
    ) -> ClientConfig:
        if tls is not None and (ca_path or cert_path or key_path):
            raise ValueError("give either tls= or ca_path/cert_path/key_path, not both")
        if tls is None:
            tls = TlsConfig(cert_path=cert_path, key_path=key_path, ca_path=ca_path)
        addresses = (address,) if isinstance(address, str) else tuple(address)
        return cls(
            addresses,
            api_key,
            tls,
            timeout_s,
            ResumePolicy(resume_timeout_s=resume_timeout_s, max_resumes=max_resumes),
        )

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None


def new_request_id() -> str:
    """A request id made here, so that a resume can name the request."""
    return f"pm-{uuid.uuid4().hex}"


def build_request(
    prompt: Prompt,
    sampling_params: SamplingParams | None,
    overrides: Mapping[str, Any],
    *,
    chat: bool = False,
    request_id: str | None = None,
    model: str | None = None,
    priority: int = 0,
    images: Images | None = None,
) -> generate_pb2.GenerateRequest:
    """The `GenerateRequest` of a call: `sampling_params` (vLLM's defaults when None) with
    `overrides` (its field names) replacing fields. Raises InvalidArgument for parameters
    the router would refuse, TypeError for an unknown keyword."""
    params = sampling_params or SamplingParams()
    try:
        if overrides:
            params = dataclasses.replace(params, **overrides)
        request = to_generate_request(
            prompt, params, chat=chat, request_id=request_id or new_request_id(), model=model or ""
        )
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc), request_id=request_id) from exc
    request.priority = priority
    request.images.extend(encoded_image(image) for image in images or ())
    return request


def encoded_image(image: Any) -> bytes:
    """An image as the wire carries it: encoded bytes as they are, a PIL image as PNG."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if hasattr(image, "save"):  # PIL.Image.Image (Pillow is imported only by whoever has one)
        import io

        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return buffer.getvalue()
    raise errors.InvalidArgument(
        f"an image must be encoded bytes or a PIL image, got {type(image).__name__}"
    )


def chat_text(messages: str | Sequence[Message]) -> str:
    """The one user message the gRPC API can put through the model's chat template.

    `Generate` and `Tokenize` take a single user text with `apply_chat_template`; a system
    prompt, earlier turns or tools cannot be expressed there, and joining them into one
    user text would silently change the prompt the model sees. So anything but one user
    message is refused: send whole conversations to the OpenAI HTTP API
    (`/v1/chat/completions`), which renders them with the model's template.
    """
    if isinstance(messages, str):
        return messages
    messages = list(messages)
    if (
        len(messages) == 1
        and messages[0].get("role") == "user"
        and isinstance(messages[0].get("content"), str)
        and set(messages[0]) <= {"role", "content"}
    ):
        return messages[0]["content"]
    roles = [m.get("role") for m in messages]
    raise errors.InvalidArgument(
        f"the gRPC API takes one user message with string content, got roles {roles}; send "
        "conversations (system prompts, several turns, tools) to the OpenAI HTTP API's "
        "/v1/chat/completions"
    )


EmbedInputs = str | bytes | list[int] | Sequence[str | bytes | list[int]]


def build_embed_request(inputs: EmbedInputs, dimensions: int | None) -> generate_pb2.EmbedRequest:
    """One text, one list of token ids, one image (bytes or PIL, for a model that embeds
    images), or a list of any of them: as OpenAI's `input`."""
    one = (
        isinstance(inputs, (str, bytes))
        or hasattr(inputs, "save")
        or (isinstance(inputs, list) and bool(inputs) and all(isinstance(t, int) for t in inputs))
    )
    items: Sequence[Any] = [inputs] if one else inputs
    request = generate_pb2.EmbedRequest(dimensions=dimensions or 0)
    item: Any
    for item in items:
        if isinstance(item, str):
            request.inputs.add(text=item)
        elif isinstance(item, (bytes, bytearray)) or hasattr(item, "save"):
            request.inputs.add(image=encoded_image(item))
        else:
            request.inputs.add(token_ids=generate_pb2.TokenIds(ids=list(item)))
    return request
