"""OpenAI's `POST /v1/embeddings`, parsed to the router's `EmbeddingRequest` and answered
from its `EmbeddingResult` (router/embedding.py does the work).

`input`: a string, a list of strings, a list of token ids, or a list of lists of token ids;
`encoding_format`: "float" (lists of numbers) or "base64" (each vector's float32
little-endian bytes, base64: what OpenAI's SDK decodes); `dimensions`: Matryoshka models
only; `user`: accepted and ignored.

vLLM's extension for models that embed images (CLIP): `messages` instead of `input`, chat
messages whose content parts are either one `image_url` (a `data:` URL; remote URLs are
not fetched) or text: one embedding, of the image or of the text.
"""

from __future__ import annotations

import base64
from typing import Any

from pagemesh.runtime.images import ImageError
from pagemesh.runtime.media import RemoteImage, image_from_url
from router.embedding import EmbeddingRequest, EmbeddingResult
from router.openai_errors import ProtocolError

ENCODING_FORMATS = ("float", "base64")
_KNOWN_FIELDS = {"input", "messages", "model", "encoding_format", "dimensions", "user", "priority"}


def parse_embeddings(body: Any, owner: str = "") -> tuple[EmbeddingRequest, str]:
    """(the request, its encoding_format); ProtocolError (400, naming the field) for a
    body OpenAI's API would refuse."""
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN_FIELDS)
    if unknown:
        raise ProtocolError(f"unknown field(s) {unknown} for /v1/embeddings", unknown[0])
    if ("input" in body) == ("messages" in body):
        raise ProtocolError(
            "send `input` (a string, a list of strings, or token ids) or, for "
            "an image, `messages` with an image_url part; one of the two",
            "input",
        )
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise ProtocolError(
            f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, not {encoding!r}",
            "encoding_format",
        )
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
    ):
        raise ProtocolError(f"dimensions must be an integer >= 1, not {dimensions!r}", "dimensions")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise ProtocolError("model must be a string", "model")
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ProtocolError("priority must be an integer", "priority")
    inputs = _inputs(body["input"]) if "input" in body else [_message_input(body["messages"])]
    return EmbeddingRequest(
        inputs=inputs, model=model, dimensions=dimensions or 0, priority=priority, owner=owner
    ), encoding


def _inputs(value: Any) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ProtocolError(
            "input must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids",
            "input",
        )
    if value and all(_is_token(v) for v in value):
        return [list(value)]
    inputs: list[str | list[int]] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, list) and all(_is_token(v) for v in item):
            inputs.append(list(item))
        else:
            raise ProtocolError(
                f"input[{index}] must be a string or a list of token ids "
                "(integers >= 0); one kind per list",
                "input",
            )
    return inputs


def _message_input(messages: Any) -> str | bytes | RemoteImage:
    """The one input of vLLM's chat-style embedding request: an image or a text."""
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list of chat messages", "messages")
    texts: list[str] = []
    images: list[bytes | RemoteImage] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise ProtocolError(
                "each message needs `content`: a string or a list of parts", "messages"
            )
        for part in parts:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                images.append(_image_url(part.get("image_url")))
            else:
                raise ProtocolError(
                    f"content part of type {kind!r} is not accepted here: "
                    "send `text` or `image_url` parts",
                    "messages",
                )
    if images and texts or len(images) > 1:
        raise ProtocolError(
            "an embedding is of one image or of text, not both: send one "
            "image_url part, or text parts only",
            "messages",
        )
    return images[0] if images else "\n".join(texts)


def _image_url(value: Any) -> bytes | RemoteImage:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ProtocolError(
            "image_url needs a `url`: a data: URL (data:image/png;base64,...) or an http(s) URL",
            "messages",
        )
    try:
        return image_from_url(url)
    except ImageError as exc:
        raise ProtocolError(str(exc), "messages") from None


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def embeddings_object(result: EmbeddingResult, model: str, encoding: str) -> dict[str, Any]:
    if encoding == "base64":
        data = [base64.b64encode(vector).decode("ascii") for vector in result.embeddings]
    else:
        data = [list(vector) for vector in result.vectors()]
    return {
        "object": "list",
        "id": f"embd-{result.request_id}",
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "usage": {
            "prompt_tokens": result.num_prompt_tokens,
            "total_tokens": result.num_prompt_tokens,
        },
    }
