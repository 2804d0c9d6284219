"""Validation of one generation request against the served model's limits.

Pure: no I/O, no gRPC. `validate` either returns a `ValidatedRequest` with every default
filled in, or raises `ValidationError` whose message says what to change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from protos.step import SamplingParams

MAX_NUM_LOGPROBS = 20
MAX_NUM_STOP_STRINGS = 16
# Characters per stop string: the router holds back output that may begin one, and checks
# each new piece against every suffix, so the cost grows with the square of this.
MAX_STOP_STRING_CHARS = 512
MAX_ABS_PRIORITY = 1_000_000  # priorities are small ranks, not timestamps
MAX_ABS_PENALTY = 2.0
MAX_SEED = 2**64 - 1
MAX_N = 16
MAX_REQUEST_ID_LEN = 256  # characters; the id keys the checkpoint in Redis and tags every log


class ValidationError(ValueError):
    """A request parameter is out of range; the message names it and says what to fix."""


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick each token. `None` means "use the default" (filled in by `validate`)."""

    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None  # in (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    repetition_penalty: float | None = None  # > 0; 1 = off
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    seed: int | None = None  # None = nondeterministic


@dataclass(frozen=True)
class StoppingOptions:
    """When to stop. `max_tokens` None means "up to the end of the context window"."""

    max_tokens: int | None = None  # generated tokens, at least 1
    min_tokens: int = 0  # generated tokens before EOS / stop ids may end the request
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts."""

    name: str
    max_model_len: int  # tokens, prompt + output
    vocab_size: int  # valid token ids are 0 .. vocab_size-1
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that fits the model. `sampling` has no None except `seed`;
    `stopping.max_tokens` is set and `prompt_len + max_tokens <= max_model_len`."""

    prompt_token_ids: list[int]
    sampling: SamplingOptions
    stopping: StoppingOptions
    num_logprobs: int | None  # top alternatives per token; None = no logprobs
    n: int = 1  # independent samples of the prompt
    priority: int = 0  # lower runs first under the priority policy
    grammar: str = ""  # the compiled output constraint (router/structured.py); "" = none

    @property
    def max_tokens(self) -> int:
        assert self.stopping.max_tokens is not None
        return self.stopping.max_tokens


def validate(
    prompt_token_ids: list[int],
    sampling: SamplingOptions,
    stopping: StoppingOptions,
    num_logprobs: int | None,
    requested_model: str,
    limits: ModelLimits,
    *,
    n: int = 1,
    priority: int = 0,
    grammar: str = "",
    options_checked: bool = False,
) -> ValidatedRequest:
    """Check a request against `limits` and fill defaults. `grammar`: its compiled output
    constraint (router/structured.py), if any. `options_checked`: `check_options` has passed
    on these options already (a `SamplingParams`, checked when it was made), so only what
    needs the model is checked here: one pass over each rule per request.

    Raises ValidationError naming the first bad parameter and its allowed range.
    """
    _check_model(requested_model, limits)
    _check_prompt(prompt_token_ids, limits)
    if not options_checked:
        check_sampling(sampling)
        check_num_logprobs(num_logprobs)
        check_num_samples(n)
    check_priority(priority)
    max_tokens = _resolve_max_tokens(len(prompt_token_ids), stopping, limits)
    if options_checked and stopping.max_tokens is not None:
        _check_token_ids("stop token id", stopping.stop_token_ids, limits.vocab_size)
    else:  # max_tokens comes from the context: min_tokens is checked against it now
        _check_stopping(stopping, max_tokens, limits)
    if grammar and stopping.ignore_eos:
        raise ValidationError(
            "ignore_eos cannot be combined with an output constraint: the "
            "output ends when the constraint is complete (EOS is all that "
            "is left then)"
        )
    return ValidatedRequest(
        prompt_token_ids=list(prompt_token_ids),
        sampling=_with_sampling_defaults(sampling),
        stopping=dataclasses.replace(stopping, max_tokens=max_tokens),
        num_logprobs=num_logprobs,
        n=n,
        priority=priority,
        grammar=grammar,
    )


def check_options(
    sampling: SamplingOptions, stopping: StoppingOptions, num_logprobs: int | None, n: int = 1
) -> None:
    """The checks of `validate` that need no model (its limits, its vocabulary), in the same
    order and words: what a client can check before any model is loaded (the offline `LLM`'s
    and the SDK's `SamplingParams`). `stopping.max_tokens` None (up to the context) passes."""
    check_sampling(sampling)
    check_num_logprobs(num_logprobs)
    check_num_samples(n)
    if stopping.max_tokens is not None:
        _check_max_tokens(stopping.max_tokens)
    _check_stop_rules(stopping, stopping.max_tokens)


def check_num_samples(n: int) -> None:
    """`n` in 1..MAX_N. Checked before anything sizes a per-sample structure by it."""
    if not 1 <= n <= MAX_N:
        raise ValidationError(f"n must be in 1..{MAX_N} (samples of one prompt), got {n}")


def check_identity(request_id: str, resume_from: int | list[int], n: int) -> None:
    """What must hold before a request is counted or looked up: its id (empty = the router
    makes one up), `resume_from`, and `n` (the router's metrics size a structure by it)."""
    if request_id:
        check_request_id(request_id)
    check_resume_from(resume_from)
    check_num_samples(n)


def check_request_id(
    request_id: str, max_len: int = MAX_REQUEST_ID_LEN, what: str = "request_id"
) -> None:
    """A client's request id: printable ASCII, at most `max_len` characters (it names the
    request's checkpoint, its logs and, over HTTP, a response header)."""
    if len(request_id) > max_len:
        raise ValidationError(f"{what} has {len(request_id)} characters; use at most {max_len}")
    if not (request_id.isascii() and request_id.isprintable()):
        raise ValidationError(f"{what} must be printable ASCII characters, got {request_id!r}")


def check_resume_from(resume_from: int | list[int]) -> None:
    """Output tokens the client already has: one count for every sample, or one per sample;
    none negative."""
    per_sample = isinstance(resume_from, list)
    offsets = resume_from if isinstance(resume_from, list) else [resume_from]
    for index, offset in enumerate(offsets):
        if offset < 0:
            where = f" (sample {index})" if per_sample else ""
            raise ValidationError(
                f"resume_from must be >= 0 (output tokens already received){where}, got {offset}"
            )


def resume_offsets(resume_from: int | list[int], num_samples: int) -> list[int]:
    """`resume_from` as one count per sample of a request with `num_samples` samples (a
    stream can break between two samples' messages, so their counts may differ)."""
    check_resume_from(resume_from)
    if not isinstance(resume_from, list):
        return [resume_from] * num_samples
    if len(resume_from) != num_samples:
        raise ValidationError(
            f"resume_from has {len(resume_from)} counts but the request has {num_samples} "
            "samples (n); send one count per sample, or a single count for every sample"
        )
    return list(resume_from)


def _check_model(requested_model: str, limits: ModelLimits) -> None:
    if requested_model and requested_model != limits.name:
        raise ValidationError(
            f"model {requested_model!r} is not served here; this server serves {limits.name!r} "
            "(or leave the model empty)"
        )


def _check_prompt(prompt_token_ids: list[int], limits: ModelLimits) -> None:
    prompt_len = len(prompt_token_ids)
    if prompt_len == 0:
        raise ValidationError("the prompt is empty; send at least one token")
    if prompt_len >= limits.max_model_len:
        raise ValidationError(
            f"prompt has {prompt_len} tokens but the model's context is {limits.max_model_len}; "
            f"shorten the prompt to at most {limits.max_model_len - 1} tokens"
        )
    _check_token_ids("prompt token id", prompt_token_ids, limits.vocab_size)


def _check_token_ids(what: str, token_ids: list[int], vocab_size: int) -> None:
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise ValidationError(
                f"{what} {token_id} at position {position} is out of range; "
                f"the vocabulary has ids 0..{vocab_size - 1}"
            )


def check_sampling(sampling: SamplingOptions) -> None:
    """Every sampling option in its range (NaN is out of every range)."""
    # Comparisons are written as "not (in range)" so that NaN is rejected too.
    if sampling.temperature is not None and not 0.0 <= sampling.temperature < math.inf:
        raise ValidationError(
            f"temperature must be a finite number >= 0 (0 = greedy), got {sampling.temperature}"
        )
    if sampling.top_p is not None and not 0.0 < sampling.top_p <= 1.0:
        raise ValidationError(f"top_p must be in (0, 1] (1 = off), got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValidationError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if not 0.0 <= sampling.min_p <= 1.0:
        raise ValidationError(f"min_p must be in [0, 1] (0 = off), got {sampling.min_p}")
    penalty = sampling.repetition_penalty
    if penalty is not None and not 0.0 < penalty < math.inf:
        raise ValidationError(
            f"repetition_penalty must be a finite number > 0 (1 = off), got {penalty}"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
            raise ValidationError(
                f"{name} must be in [-{MAX_ABS_PENALTY:g}, {MAX_ABS_PENALTY:g}], got {value}"
            )
    if sampling.seed is not None and not 0 <= sampling.seed <= MAX_SEED:
        raise ValidationError(f"seed must be in [0, 2**64 - 1], got {sampling.seed}")


def check_num_logprobs(num_logprobs: int | None) -> None:
    """Alternatives per token in 0..MAX_NUM_LOGPROBS, or None (no logprobs)."""
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_NUM_LOGPROBS:
        raise ValidationError(f"logprobs must be in [0, {MAX_NUM_LOGPROBS}], got {num_logprobs}")


def _resolve_max_tokens(prompt_len: int, stopping: StoppingOptions, limits: ModelLimits) -> int:
    max_allowed = limits.max_model_len - prompt_len
    if stopping.max_tokens is None:
        return max_allowed
    _check_max_tokens(stopping.max_tokens)
    if stopping.max_tokens > max_allowed:
        raise ValidationError(
            f"prompt ({prompt_len} tokens) + max_tokens ({stopping.max_tokens}) exceeds the "
            f"model's context of {limits.max_model_len} tokens; set max_tokens to at most "
            f"{max_allowed} or shorten the prompt"
        )
    return stopping.max_tokens


def _check_max_tokens(max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValidationError(f"max_tokens must be at least 1, got {max_tokens}")


def _check_stopping(stopping: StoppingOptions, max_tokens: int, limits: ModelLimits) -> None:
    _check_stop_rules(stopping, max_tokens)
    _check_token_ids("stop token id", stopping.stop_token_ids, limits.vocab_size)


def _check_stop_rules(stopping: StoppingOptions, max_tokens: int | None) -> None:
    """min_tokens and the stop strings; `max_tokens` None = not known yet."""
    if stopping.min_tokens < 0:
        raise ValidationError(f"min_tokens must be >= 0, got {stopping.min_tokens}")
    if max_tokens is not None and stopping.min_tokens > max_tokens:
        raise ValidationError(
            f"min_tokens ({stopping.min_tokens}) must not exceed max_tokens ({max_tokens})"
        )
    if len(stopping.stop) > MAX_NUM_STOP_STRINGS:
        raise ValidationError(
            f"at most {MAX_NUM_STOP_STRINGS} stop strings are allowed, got {len(stopping.stop)}"
        )
    for index, stop in enumerate(stopping.stop):
        if not stop:
            raise ValidationError(f"stop string {index} is empty; remove it")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise ValidationError(
                f"stop string {index} is {len(stop):,} characters; at most "
                f"{MAX_STOP_STRING_CHARS} are accepted"
            )
        check_unicode(stop, f"stop string {index}")


def check_priority(priority: int) -> None:
    if not -MAX_ABS_PRIORITY <= priority <= MAX_ABS_PRIORITY:
        raise ValidationError(
            f"priority must be in [-{MAX_ABS_PRIORITY:,}, {MAX_ABS_PRIORITY:,}] "
            f"(lower runs first), got {priority:,}"
        )


def check_unicode(text: str, what: str) -> None:
    """JSON may carry lone surrogates (\\ud800), which no tokenizer can encode."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValidationError(
            f"{what} is not valid Unicode: {exc.reason} at character {exc.start} "
            f"({text[exc.start : exc.end]!a}); send UTF-8 text"
        ) from None


def _with_sampling_defaults(sampling: SamplingOptions) -> SamplingOptions:
    """Unset fields take `SamplingParams`' defaults, the one place they are written (the
    scheduler applies the same ones to a field a router left unset). The seed stays unset:
    the servicer draws it."""
    unset = {
        f.name: getattr(_DEFAULTS, f.name)
        for f in dataclasses.fields(sampling)
        if getattr(sampling, f.name) is None and f.name != "seed"
    }
    return dataclasses.replace(sampling, **unset)


_DEFAULTS = SamplingParams()
