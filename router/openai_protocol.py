"""OpenAI's HTTP API in pure functions: JSON bodies in, `GenerationRequest`s out, and
`TokenChunk`s back into OpenAI's completion / chat completion objects (router/types.py).

No I/O here: `router.http_api` owns the HTTP side. Parsing checks every field's type, that
each integer fits the protobuf field it travels in (pagemesh/api/options/fields.py), and the fields
OpenAI has
that pagemesh does not serve. Value ranges (temperature >= 0, max_tokens >= 1, n <= 16, ...)
are left to the data plane's validation (pagemesh/api/options/validation.py), so that HTTP and gRPC
reject
the same requests with the same words. Either way a bad request is a `ProtocolError` (4xx).

Resuming after a router died (docs/fault-tolerance.md): the client names its request with
the `X-Request-Id` header (or vLLM's `request_id` body field) and, to resume, says how many
output tokens of each choice it has with `X-Resume-From` (or a `resume_from` body field);
`return_token_ids` (vLLM's extension) puts each chunk's token ids in its choices to count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pagemesh.api.options import fields
from pagemesh.api.options.constraint import constraint_from_body
from pagemesh.api.options.validation import MAX_REQUEST_ID_LEN, ValidationError, check_request_id
from pagemesh.runtime.images import ImageError
from pagemesh.runtime.media import RemoteImage, image_from_url
from router.openai_errors import ProtocolError, error_body  # noqa: F401 (oai.ProtocolError)
from router.openai_tools import (
    ToolRequest,
    forced_call_constraint,
    tool_calls_for_template,
    tool_request,
)
from router.tool_calls import HERMES, CallFormat
from router.types import BeamOptions, GenerationRequest, ModelInfo, TokenChunk, Usage

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REQUEST_ID_HEADER = "X-Request-Id"  # vLLM's; the router echoes it on every answer
RESUME_FROM_HEADER = "X-Resume-From"  # output tokens the client has: "12", or "12,11" per choice
# vLLM's response ids, "<prefix><request id>": the prefixed id is the request's id in the
# mesh too (its checkpoint, its trace's gen_ai.response.id), so a client's id leaves room.
CHAT_ID_PREFIX, COMPLETION_ID_PREFIX = "chatcmpl-", "cmpl-"
MAX_CLIENT_REQUEST_ID_LEN = MAX_REQUEST_ID_LEN - len(CHAT_ID_PREFIX)


@dataclass
class ParsedRequest:
    """An OpenAI request turned into pagemesh's; chat messages are left for the tokenizer
    (their token ids become `generate.prompt`). `client_request_id` is the id the client
    set, or empty (the API makes one up); `generate.request_id` is it after `id_prefix`."""

    generate: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    # Alternatives per token the client asked for; None = no logprobs at all.
    num_top_logprobs: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolRequest | None = None  # chat: the tools the template shows the model
    # chat: the format the reply's tool calls are parsed in; None = the reply is all content
    tool_format: CallFormat | None = None
    return_token_ids: bool = False  # each choice carries its (new) token ids
    client_request_id: str = ""
    id_prefix: str = COMPLETION_ID_PREFIX


# ---------------------------------------------------------------- request parsing


def _field_errors_as_protocol_errors(
    parse: Callable[..., ParsedRequest],
) -> Callable[..., ParsedRequest]:
    """A field of the wrong type (pagemesh/api/options/fields.py) is a 400 naming the field."""

    @functools.wraps(parse)
    def wrapped(*args: Any, **kwargs: Any) -> ParsedRequest:
        try:
            return parse(*args, **kwargs)
        except fields.FieldError as exc:
            raise ProtocolError(exc.message, exc.param) from None

    return wrapped


@_field_errors_as_protocol_errors
def parse_completion(body: Any, headers: Mapping[str, str] | None = None) -> ParsedRequest:
    """A `/v1/completions` body and its headers (case-insensitive, as Starlette's, or
    lower-case keys). Raises ProtocolError saying what to fix."""
    body = _object(body)
    _reject_unsupported(body, {"echo": False, "suffix": None, "logit_bias": {}})
    prompt = _prompt(body.get("prompt"))
    max_tokens = fields.integer(body, "max_tokens")
    num_top = fields.integer(body, "logprobs")
    if num_top is not None and num_top < 0:
        raise ProtocolError(f"logprobs must be >= 0, got {num_top}", "logprobs")
    return _parse_common(
        body,
        headers,
        COMPLETION_ID_PREFIX,
        prompt,
        DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
        num_top,
    )


@_field_errors_as_protocol_errors
def parse_chat(
    body: Any, headers: Mapping[str, str] | None = None, tool_format: CallFormat = HERMES
) -> ParsedRequest:
    """A `/v1/chat/completions` body; `messages` comes back normalized for the chat template.
    `tool_format`: how the served model writes tool calls (router/tool_calls.py)."""
    body = _object(body)
    _reject_unsupported(body, {"logit_bias": {}})
    tools = tool_request(body)  # before the constraint: a forced call names what conflicts
    max_tokens = fields.integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = fields.integer(body, "max_tokens")
    num_top = fields.integer(body, "top_logprobs")
    wants_logprobs = fields.boolean(body, "logprobs")
    if num_top is not None and not wants_logprobs:
        raise ProtocolError("top_logprobs needs logprobs set to true", "top_logprobs")
    if num_top is not None and num_top < 0:
        raise ProtocolError(f"top_logprobs must be >= 0, got {num_top}", "top_logprobs")
    parsed = _parse_common(
        body, headers, CHAT_ID_PREFIX, None, max_tokens, (num_top or 0) if wants_logprobs else None
    )
    images: list[bytes] = []
    parsed.messages = chat_messages(body.get("messages"), images)
    if images:
        parsed.generate = dataclasses.replace(parsed.generate, images=images)
    if tools is not None:
        parsed.tools = tools
        parsed.tool_format = tool_format if tools.parses_calls else None
        forced = forced_call_constraint(tools, tool_format)
        if forced is not None:
            parsed.generate = dataclasses.replace(parsed.generate, constraint=forced)
    return parsed


def _image_bytes(value: Any, where: str) -> bytes | RemoteImage:
    """An image_url part's image: a data: URL's bytes, or an http(s) URL the router fetches
    (from the hosts --allowed-media-domains lists)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ProtocolError(
            "an image_url part needs a `url`: a data: URL (data:image/png;"
            "base64,...) or an http(s) URL",
            f"{where}.content",
        )
    try:
        return image_from_url(url)
    except ImageError as exc:
        raise ProtocolError(str(exc), f"{where}.content") from None


def _parse_common(
    body: dict[str, Any],
    headers: Mapping[str, str] | None,
    id_prefix: str,
    prompt: str | list[int] | None,
    max_tokens: int | None,
    num_top: int | None,
) -> ParsedRequest:
    model = fields.string(body, "model")
    sampling = fields.sampling_options(body)
    stopping = fields.stopping_options(body, max_tokens)
    n = fields.integer(body, "n")
    request_id, resume_from = _identity(body, headers or {})
    request = GenerationRequest(
        request_id=id_prefix + request_id if request_id else "",
        prompt=prompt,
        sampling=sampling,
        stopping=stopping,
        # The chosen token's logprob comes with any top-n > 0; extra alternatives are dropped.
        num_logprobs=None if num_top is None else max(num_top, 1),
        n=1 if n is None else n,
        priority=fields.integer(body, "priority") or 0,
        resume_from=0 if resume_from is None else resume_from,
        model=model or "",
        # Only a resume looks a checkpoint up: an X-Request-Id alone (proxies add one to
        # every request) is a new request, as in vLLM, and costs no Redis lookup.
        new_request=resume_from is None,
        constraint=constraint_from_body(body),  # structured output (response_format, guided_*)
        beam=_beam_options(body, n),
    )
    stream = bool(fields.boolean(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ProtocolError("stream_options needs stream set to true", "stream_options")
        include_usage = bool(fields.boolean(_object(options, "stream_options"), "include_usage"))
    return ParsedRequest(
        request,
        stream,
        include_usage,
        num_top,
        return_token_ids=bool(fields.boolean(body, "return_token_ids")),
        client_request_id=request_id,
        id_prefix=id_prefix,
    )


def _beam_options(body: dict[str, Any], n: int | None) -> BeamOptions | None:
    """vLLM's `use_beam_search` with `length_penalty` (and transformers' `early_stopping`):
    `best_of` beams (default n), the n best returned. `best_of` without beam search is
    OpenAI's sampling of the best of several, which pagemesh does not serve."""
    best_of = body.get("best_of")
    if best_of is not None and not fields.is_int(best_of):
        raise ProtocolError(f"best_of must be an integer, got {fields.shown(best_of)}", "best_of")
    if not fields.boolean(body, "use_beam_search"):
        if best_of not in (None, 1):
            raise ProtocolError(
                "best_of is served with use_beam_search only (the beam width); "
                "to sample several answers, use n",
                "best_of",
            )
        for name in ("length_penalty", "early_stopping"):
            if body.get(name) is not None:
                raise ProtocolError(
                    f"{name} applies to beam search: set use_beam_search true, or drop it", name
                )
        return None
    width = best_of if best_of is not None else (1 if n is None else n)
    if width < 1:
        raise ProtocolError(f"best_of must be >= 1, got {width}", "best_of")
    length_penalty = fields.number(body, "length_penalty")
    early = body.get("early_stopping", False)
    if early not in (True, False, "never"):
        raise ProtocolError(
            f'early_stopping must be true, false or "never", got {fields.shown(early)}',
            "early_stopping",
        )
    return BeamOptions(width, 1.0 if length_penalty is None else length_penalty, early)


def _identity(
    body: dict[str, Any], headers: Mapping[str, str]
) -> tuple[str, int | list[int] | None]:
    """The client's request id and resume offsets (None: not a resume); a header wins over
    its body field, as vLLM's X-Request-Id does over `request_id`."""
    request_id = _header(headers, REQUEST_ID_HEADER)
    what = REQUEST_ID_HEADER
    if not request_id:
        request_id, what = fields.string(body, "request_id") or "", "request_id"
    if request_id:
        try:  # the data plane's rule, for the id the client wrote
            check_request_id(request_id, MAX_CLIENT_REQUEST_ID_LEN, what)
        except ValidationError as exc:
            raise ProtocolError(str(exc), what) from exc
    text = _header(headers, RESUME_FROM_HEADER)
    if text is not None:
        return request_id, _resume_from_header(text)
    value = body.get("resume_from")
    if value is None:
        return request_id, None
    if fields.is_int(value):
        return request_id, fields.on_wire("resume_from", value)
    if isinstance(value, list) and value and all(fields.is_int(v) for v in value):
        return request_id, [
            fields.on_wire("resume_from", v, f"resume_from[{i}]") for i, v in enumerate(value)
        ]
    raise ProtocolError(
        "resume_from must be the number of output tokens received (one for every "
        f"choice, or a list with one per choice), got {fields.shown(value)}",
        "resume_from",
    )


def _header(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name.lower())
    return value if value is None else value.strip()


def _resume_from_header(text: str) -> int | list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and len(part) <= 20 for part in parts):
        raise ProtocolError(
            f"{RESUME_FROM_HEADER} must be the number of output tokens received: one for every "
            "choice (e.g. 12) or one per choice, comma-separated (e.g. 12,11); "
            f"got {fields.shown(text)}",
            RESUME_FROM_HEADER,
        )
    offsets = [
        fields.on_wire("resume_from", int(part), RESUME_FROM_HEADER, RESUME_FROM_HEADER)
        for part in parts
    ]
    return offsets[0] if len(offsets) == 1 else offsets


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("prompt is empty; send at least one character", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(fields.is_int(t) for t in prompt):
        return [
            fields.on_wire("prompt", t, f"prompt token id at position {i}")
            for i, t in enumerate(prompt)
        ]
    if (
        isinstance(prompt, list)
        and len(prompt) > 1
        and all(isinstance(p, (str, list)) for p in prompt)
    ):
        raise ProtocolError(
            f"prompt holds {len(prompt)} prompts; this server takes one prompt per request "
            "(send one request per prompt)",
            "prompt",
        )
    raise ProtocolError(
        "prompt must be a non-empty string or a non-empty list of token ids", "prompt"
    )


def chat_messages(value: Any, images: list[bytes] | None = None) -> list[dict[str, Any]]:
    """OpenAI's `messages`, checked and normalized for the chat template (which
    pagemesh/runtime/tokenizer.py `apply_chat_messages` applies, for the router and the
    offline `LLM.chat` alike); `images` receives the bytes of their image_url parts (data:
    URLs), in order, each part becoming {"type": "image"} for the template."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(
            "messages must be a non-empty list of {role, content} objects", "messages"
        )
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        message = _object(message, where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ProtocolError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {fields.shown(role)}",
                f"{where}.role",
            )
        normalized: dict[str, Any] = {
            "role": role,
            "content": _content(message.get("content"), where, images),
        }
        if role == "assistant" and message.get("tool_calls") is not None:
            normalized["tool_calls"] = tool_calls_for_template(message["tool_calls"], where)
        if role == "tool":
            for key in ("tool_call_id", "name"):
                value = message.get(key)
                if value is not None and not isinstance(value, str):
                    raise ProtocolError(f"{where}.{key} must be a string", f"{where}.{key}")
                if value is not None:
                    normalized[key] = value
        messages.append(normalized)
    return messages


def _content(
    content: Any, where: str, images: list[bytes] | None = None
) -> str | list[dict[str, Any]]:
    """A message's content: a string, or, with image parts, the parts for the template
    (text ones, and {"type": "image"} where an image was; its bytes go to `images`)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and images is not None:
                images.append(_image_bytes(part.get("image_url"), where))
                parts.append({"type": "image"})
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise ProtocolError(
                    f'{where}.content parts must be {{"type": "text", '
                    '"text": ...}} or {"type": "image_url", ...} '
                    "(vision-language models); audio is not supported",
                    f"{where}.content",
                )
        if any(p["type"] == "image" for p in parts):
            return parts
        return "".join(p["text"] for p in parts)
    raise ProtocolError(
        f"{where}.content must be a string or a list of text parts", f"{where}.content"
    )


def _reject_unsupported(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    for name, default in defaults.items():
        value = body.get(name)
        if value is not None and value != default:
            raise ProtocolError(f"{name} is not supported by this server; remove it", name)


def _object(value: Any, what: str = "the request body") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(
            f"{what} must be a JSON object", None if what == "the request body" else what
        )
    return value


# ---------------------------------------------------------------- response building


@dataclass
class ChoiceDelta:
    """What one `TokenChunk` adds to one choice, logprobs already OpenAI-shaped."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]]
    finish_reason: str | None


def choice_delta(chunk: TokenChunk, num_top_logprobs: int | None) -> ChoiceDelta:
    """Logprob entries are `{"token_id", "logprob", "top": [(token_id, logprob)]}`; the
    `*_logprobs` builders below turn them into OpenAI's shapes."""
    logprobs = []
    if num_top_logprobs is not None:
        for lp in chunk.logprobs:
            top = [(t.token_id, t.logprob) for t in lp.top[:num_top_logprobs]]
            logprobs.append({"token_id": lp.token_id, "logprob": lp.logprob, "top": top})
    finish_reason = None if chunk.finish_reason is None else chunk.finish_reason.value
    return ChoiceDelta(chunk.index, chunk.text, chunk.token_ids, logprobs, finish_reason)


def usage(counts: Usage) -> dict[str, Any]:
    """OpenAI's usage; with speculative decoding, pagemesh's extension `spec_decode` (the
    draft tokens verified and kept for this request)."""
    prompt, completion = counts.num_prompt_tokens, counts.num_completion_tokens
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if counts.num_draft_tokens:
        body["spec_decode"] = {
            "num_draft_tokens": counts.num_draft_tokens,
            "num_accepted_tokens": counts.num_accepted_tokens,
        }
    return body


def completion_logprobs(
    entries: list[dict[str, Any]], token_text: dict[int, str], text_offset: int = 0
) -> dict[str, Any]:
    """Completions-style logprobs; `text_offset` is where the first token starts in the output."""
    tokens, offsets = [], []
    for entry in entries:
        text = token_text.get(entry["token_id"], "")
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{token_text.get(i, ""): lp for i, lp in e["top"]} for e in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[dict[str, Any]], token_text: dict[int, str]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text.get(token_id, "")
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **item(e["token_id"], e["logprob"]),
                "top_logprobs": [item(i, lp) for i, lp in e["top"]],
            }
            for e in entries
        ]
    }


def completion_object(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    body = {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def chat_object(
    response_id: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    body = {
        "id": response_id,
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def completion_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(
    index: int,
    text: str | None,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """`text` is None for a reply that is only tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None, finish_reason: str | None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def models_object(info: ModelInfo, created: int, adapters: Iterable[str] = ()) -> dict[str, Any]:
    """The served model, then its LoRA adapters (each with the model as `parent` and `root`,
    as vLLM lists them); `task` says what the model does ("generate": /v1/completions and
    /v1/chat/completions; "embed": /v1/embeddings, with its vector size and pooling)."""
    model: dict[str, Any] = {
        "id": info.model,
        "object": "model",
        "created": created,
        "owned_by": "pagemesh",
        "max_model_len": info.max_model_len,
        "quantization": info.quantization,
        "task": info.pooling.task,
    }
    if info.pooling.embeds:
        model["embedding_dimensions"] = info.pooling.embedding_size
        model["pooling"] = {
            "type": info.pooling.pooling_type,
            "normalize": info.pooling.normalize,
            "matryoshka_dimensions": list(info.pooling.matryoshka_dimensions),
            "any_dimensions": info.pooling.any_dimensions,
        }
    loras = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pagemesh",
            "root": info.model,
            "parent": info.model,
            "max_model_len": info.max_model_len,
            "task": info.pooling.task,
        }
        for name in sorted(adapters)
    ]
    return {"object": "list", "data": [model, *loras]}
