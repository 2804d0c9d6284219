"""OpenAI's HTTP API in pure functions: JSON bodies in, `GenerationRequest`s out, and
`TokenChunk`s back into OpenAI's completion / chat completion objects (router/types.py).

No I/O here: `router.http_api` owns the HTTP side. Parsing checks types and the fields OpenAI
has that pagemesh does not serve; value ranges (temperature >= 0, max_tokens >= 1, ...) are left
to the data plane's validation so that HTTP and gRPC reject the same requests with the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from router.types import GenerationRequest, ModelInfo, TokenChunk, Usage
from router.validation import SamplingOptions, StoppingOptions

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat has none
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

class ProtocolError(ValueError):
    """A request OpenAI's API would reject; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class ParsedRequest:
    """An OpenAI request turned into pagemesh's; chat messages are left for the tokenizer
    (their token ids become `generate.prompt`)."""

    generate: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    # Alternatives per token the client asked for; None = no logprobs at all.
    num_top_logprobs: int | None = None
    messages: list[dict[str, str]] = field(default_factory=list)


# ---------------------------------------------------------------- request parsing


def parse_completion(body: Any) -> ParsedRequest:
    """A `/v1/completions` body. Raises ProtocolError saying what to fix."""
    body = _object(body)
    _reject_unsupported(body, {"echo": False, "suffix": None, "best_of": 1, "logit_bias": {}})
    prompt = _prompt(body.get("prompt"))
    max_tokens = _int(body, "max_tokens")
    num_top = _int(body, "logprobs")
    if num_top is not None and num_top < 0:
        raise ProtocolError(f"logprobs must be >= 0, got {num_top}", "logprobs")
    return _parse_common(body, prompt, DEFAULT_COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens,
                         num_top)


def parse_chat(body: Any) -> ParsedRequest:
    """A `/v1/chat/completions` body; `messages` comes back normalized for the chat template."""
    body = _object(body)
    _reject_unsupported(body, {"tools": [], "logit_bias": {}})
    if body.get("tool_choice") not in (None, "none"):
        raise ProtocolError("tool calls are not supported; remove tool_choice", "tool_choice")
    response_format = body.get("response_format")
    if response_format is not None and _object(response_format, "response_format").get("type") != "text":
        raise ProtocolError("only response_format {\"type\": \"text\"} is supported",
                            "response_format")
    max_tokens = _int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    num_top = _int(body, "top_logprobs")
    wants_logprobs = _bool(body, "logprobs")
    if num_top is not None and not wants_logprobs:
        raise ProtocolError("top_logprobs needs logprobs set to true", "top_logprobs")
    if num_top is not None and num_top < 0:
        raise ProtocolError(f"top_logprobs must be >= 0, got {num_top}", "top_logprobs")
    parsed = _parse_common(body, None, max_tokens, (num_top or 0) if wants_logprobs else None)
    parsed.messages = _messages(body.get("messages"))
    return parsed


def _parse_common(body: dict[str, Any], prompt: str | list[int] | None, max_tokens: int | None,
                  num_top: int | None) -> ParsedRequest:
    model = _str(body, "model")
    # Read in the order the fields' errors should be reported.
    numbers = {name: _number(body, name) for name in (
        "temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "min_p")}
    top_k = _int(body, "top_k")
    seed = _int(body, "seed")
    if seed is not None and seed < 0:
        raise ProtocolError(f"seed must be >= 0, got {seed}", "seed")
    sampling = SamplingOptions(
        temperature=numbers["temperature"],
        top_p=numbers["top_p"],
        top_k=0 if top_k in (None, -1) else top_k,  # vLLM's -1 = off; other negatives are rejected
        min_p=numbers["min_p"] or 0.0,
        repetition_penalty=numbers["repetition_penalty"],
        presence_penalty=numbers["presence_penalty"] or 0.0,
        frequency_penalty=numbers["frequency_penalty"] or 0.0,
        seed=seed,
    )
    stop = _stop(body.get("stop"))
    stop_token_ids = _int_list(body, "stop_token_ids")
    stopping = StoppingOptions(max_tokens=max_tokens, stop=stop, stop_token_ids=stop_token_ids,
                               min_tokens=_non_negative(body, "min_tokens"),
                               ignore_eos=bool(_bool(body, "ignore_eos")))
    n = _int(body, "n")
    if n is not None and n < 1:
        raise ProtocolError(f"n must be at least 1, got {n}", "n")
    request = GenerationRequest(
        prompt=prompt,
        sampling=sampling,
        stopping=stopping,
        # The chosen token's logprob comes with any top-n > 0; extra alternatives are dropped.
        num_logprobs=None if num_top is None else max(num_top, 1),
        n=1 if n is None else n,
        priority=_int(body, "priority") or 0,
        model=model or "",
    )
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise ProtocolError("stream_options needs stream set to true", "stream_options")
        include_usage = bool(_bool(_object(options, "stream_options"), "include_usage"))
    return ParsedRequest(request, stream, include_usage, num_top)


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ProtocolError("prompt is empty; send at least one character", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if any(t < 0 for t in prompt):
            raise ProtocolError("prompt token ids must be >= 0", "prompt")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError(
            f"prompt holds {len(prompt)} prompts; this server takes one prompt per request "
            "(send one request per prompt)", "prompt")
    raise ProtocolError(
        "prompt must be a non-empty string or a non-empty list of token ids", "prompt")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ProtocolError("messages must be a non-empty list of {role, content} objects",
                            "messages")
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        message = _object(message, where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ProtocolError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                f"{where}.role")
        messages.append({"role": role, "content": _content(message.get("content"), where)})
    return messages


def _content(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError(f"{where}.content parts must be {{\"type\": \"text\", \"text\": ...}}; "
                                    "images and audio are not supported", f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise ProtocolError(f"{where}.content must be a string or a list of text parts",
                        f"{where}.content")


def _stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ProtocolError("stop must be a string or a list of strings", "stop")


def _reject_unsupported(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    for name, default in defaults.items():
        value = body.get(name)
        if value is not None and value != default:
            raise ProtocolError(f"{name} is not supported by this server; remove it", name)


def _object(value: Any, what: str = "the request body") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object", None if what == "the request body" else what)
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None or _is_int(value):
        return value
    raise ProtocolError(f"{name} must be an integer, got {value!r}", name)


def _non_negative(body: dict[str, Any], name: str) -> int:
    value = _int(body, name) or 0
    if value < 0:
        raise ProtocolError(f"{name} must be >= 0, got {value}", name)
    return value


def _int_list(body: dict[str, Any], name: str) -> list[int]:
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value):
        return value
    raise ProtocolError(f"{name} must be a list of token ids (integers >= 0)", name)


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ProtocolError(f"{name} must be a finite number, got {value!r}", name)


def _bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise ProtocolError(f"{name} must be true or false, got {value!r}", name)


def _str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise ProtocolError(f"{name} must be a string, got {value!r}", name)


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


def usage(counts: Usage) -> dict[str, int]:
    prompt, completion = counts.num_prompt_tokens, counts.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_logprobs(entries: list[dict[str, Any]], token_text: dict[int, str],
                        text_offset: int = 0) -> dict[str, Any]:
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

    return {"content": [
        {**item(e["token_id"], e["logprob"]), "top_logprobs": [item(i, lp) for i, lp in e["top"]]}
        for e in entries
    ]}


def completion_object(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                      usage: dict[str, int] | None, chunk: bool = False) -> dict[str, Any]:
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def chat_object(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                usage: dict[str, int] | None, chunk: bool = False) -> dict[str, Any]:
    body = {"id": response_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created, "model": model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def models_object(info: ModelInfo, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{
        "id": info.model, "object": "model", "created": created, "owned_by": "pagemesh",
        "max_model_len": info.max_model_len, "quantization": info.quantization,
    }]}
