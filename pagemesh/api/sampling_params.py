"""`SamplingParams`: how to generate, in vLLM's names, shared by the offline `pagemesh.LLM`
and the Python gRPC client (`pagemesh.api.sdk`).

A vLLM script keeps its `SamplingParams(...)` as written: the fields, their defaults
(`max_tokens=16`, `top_k` 0 or -1 = off, `logprobs=None`) and their meaning are vLLM's.
A bad value raises `ValueError` at construction, with the words the servers use: the
types are checked by the field readers the OpenAI API uses too (pagemesh/api/options/fields.py)
and the ranges by the data plane's validation (pagemesh/api/options/validation.py
`check_options`), so the offline engine, the HTTP API and the gRPC API reject the same
parameters the same way. What needs the model
(max_tokens against the context, stop token ids against the vocabulary) is checked when the
request meets the model.

`to_generate_request` turns a prompt and its parameters into the router's `GenerateRequest`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagemesh.api.options import fields
from pagemesh.api.options.constraint import OutputConstraint, constraint_from_structured
from pagemesh.api.options.validation import (
    SamplingOptions,
    StoppingOptions,
    ValidationError,
    check_options,
)

__all__ = ["SamplingParams", "StructuredOutputsParams", "RequestOptions", "to_generate_request"]

_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must be (vLLM's `StructuredOutputsParams`); set exactly one.

    `json`: a JSON Schema (a dict, or its JSON text); `regex`: a regular expression (Rust
    `regex` syntax) the whole output matches; `choice`: the strings the output may be;
    `grammar`: a Lark (llguidance) or GBNF grammar; `json_object`: any JSON object.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in _STRUCTURED_FIELDS
            if getattr(self, name) is not None
        }


@dataclass(frozen=True)
class RequestOptions:
    """A `SamplingParams` in the data plane's vocabulary (pagemesh/api/options/validation.py),
    checked."""

    sampling: SamplingOptions
    stopping: StoppingOptions  # max_tokens None = up to the end of the context
    num_logprobs: int | None  # alternatives asked of the engine (>= 1), None = no logprobs
    n: int
    constraint: OutputConstraint | None


@dataclass
class SamplingParams:
    """How to generate one prompt's outputs (vLLM's `SamplingParams`).

    Units: `max_tokens`, `min_tokens` count generated tokens per output; `logprobs` counts
    alternatives per token; probabilities are natural logs.

    - n: independent outputs of the prompt, 1..16 (output i is seeded `seed + i`).
    - temperature: softmax temperature >= 0; 0 = greedy.
    - top_p: nucleus sampling, in (0, 1]; 1 = off.
    - top_k: keep the k most likely tokens; 0 or -1 = off.
    - min_p: drop tokens below min_p times the top token's probability, in [0, 1]; 0 = off.
    - seed: the output's random draws depend only on it (not on the batch); None = a fresh
      seed per request, in [0, 2**64 - 1].
    - max_tokens: most tokens to generate, >= 1 (default 16, as vLLM); None = up to the
      end of the model's context.
    - min_tokens: tokens to generate before EOS or a stop token id may end the output.
    - stop: strings that end the output; the text stops before the match. At most 16.
    - stop_token_ids: token ids that end the output, besides the model's EOS.
    - ignore_eos: keep generating past EOS.
    - logprobs: None = no logprobs; k >= 0 = each generated token's logprob and its k most
      likely alternatives (0..20), as vLLM's.
    - presence_penalty, frequency_penalty: OpenAI's penalties, in [-2, 2].
    - repetition_penalty: multiplicative penalty on prompt and output tokens, > 0; 1 = off.
    - skip_special_tokens: leave special tokens out of the returned text.
    - include_stop_str_in_output: the returned text ends with the stop string that ended it.
    - detokenize: False returns token ids with empty text (no stop strings then).
    - structured_outputs: a `StructuredOutputsParams` (or a dict of its fields); None = free text.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._checked: tuple[tuple[str, ...], RequestOptions] | None = None
        self.options()

    def options(self) -> RequestOptions:
        """These parameters in the data plane's vocabulary. Raises ValueError (the servers'
        message) for a wrong type or a value out of range.

        Checked once: at construction, and again only when a field has changed since (so a
        request made from these parameters is not validated a second time on its way)."""
        snapshot = tuple(repr(getattr(self, f.name)) for f in dataclasses.fields(self))
        if self._checked is None or self._checked[0] != snapshot:
            self._checked = (snapshot, self._check())
        return self._checked[1]

    def _check(self) -> RequestOptions:
        given = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        sampling = fields.sampling_options(given)
        stopping = fields.stopping_options(given, fields.integer(given, "max_tokens"))
        num_top = fields.integer(given, "logprobs")
        if num_top is not None and num_top < 0:
            raise ValidationError(f"logprobs must be >= 0, got {num_top}")
        # The chosen token's logprob comes with any count (vLLM's logprobs=0 included).
        num_logprobs = None if num_top is None else max(num_top, 1)
        n = fields.integer(given, "n")
        n = 1 if n is None else n
        check_options(sampling, stopping, num_logprobs, n)
        for name in ("skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            fields.boolean(given, name)
        if not self.detokenize and stopping.stop:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        return RequestOptions(sampling, stopping, num_logprobs, n, self._constraint())

    def _constraint(self) -> OutputConstraint | None:
        structured = self.structured_outputs
        if isinstance(structured, StructuredOutputsParams):
            structured = structured.to_dict()
        return constraint_from_structured(structured)

    def clone(self) -> SamplingParams:
        return dataclasses.replace(self)


def to_generate_request(
    prompt: str | list[int],
    params: SamplingParams,
    *,
    chat: bool = False,
    request_id: str = "",
    model: str = "",
):
    """The router's `GenerateRequest` (protos/pagemesh/v1/generate.proto) for `prompt`
    (text, or token ids) with `params`. `chat`: the text is one user message, put through
    the model's chat template by the router. Raises ValueError for parameters the servers
    would refuse (those that need the model are left to the router). The text options
    (skip_special_tokens, include_stop_str_in_output, detokenize) are the client's to
    apply: the router's text skips special tokens and stops before a stop string."""
    # protobuf only for the gRPC client
    from pagemesh.api.options.messages import sampling_message, stopping_message
    from protos.pagemesh.v1 import generate_pb2

    options = params.options()
    s, stopping = options.sampling, options.stopping
    request = generate_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        apply_chat_template=chat,
        n=options.n,
        # The chosen token's logprob comes with any count > 0 (vLLM's logprobs=0 included).
        logprobs=options.num_logprobs or 0,
        sampling=sampling_message(s),
        stopping=stopping_message(stopping),
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif chat:
        raise ValueError("apply_chat_template needs a `text` prompt, not `token_ids`")
    else:
        request.token_ids.ids.extend(_token_ids(prompt))
    if options.constraint is not None:
        request.constraint.CopyFrom(_constraint_pb(generate_pb2, options.constraint))
    return request


def _token_ids(prompt: list[int]) -> list[int]:
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    return prompt


def _constraint_pb(generate_pb2: Any, constraint: OutputConstraint) -> Any:
    kind, value = constraint.kind, constraint.value
    if kind == "json_object":
        return generate_pb2.OutputConstraint(json_object=True)
    if kind == "choice":
        return generate_pb2.OutputConstraint(choice=generate_pb2.Choices(choices=list(value)))
    return generate_pb2.OutputConstraint(**{kind: value})
