"""One `LLM.generate` call's requests, from prompts to `RequestOutput`s, with the router's
and the scheduler's own pieces so that a request means here what it means in the mesh:

- `prepare`: the data plane's validation (pagemesh/api/options/validation.py `validate`, the
servers'
  messages), its seed for unseeded requests (`Submission.fresh`), its compiled output
  constraint (router/structured.py), then the core's admission door
  (scheduler_svc/core/admission.py `core_request`: EOS and stop ids, the defaults; one
  request per sample with seed + i, samples forking from the first one's prompt), the
  same rules the scheduler applies to the router's `SubmitRequest`, with no protobuf;
- `BatchSink`: the engine loop's sink for the whole call; each sample's tokens go through
  the router's `SampleStream` (incremental detokenization, stop strings); a sample a stop
  string ends is aborted in the engine at once, as the router aborts it in the mesh.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offline.outputs import CompletionOutput, Logprob, RequestOutput
from pagemesh.api.options.validation import ModelLimits, validate
from pagemesh.api.sampling_params import SamplingParams
from pagemesh.runtime.tokenizer import Tokenizer
from protos.step import ImageInput, LoraRef
from router.detokenizer import IncrementalDetokenizer
from router.sample_stream import SampleStream
from router.structured import GrammarCompiler
from router.types import FinishReason, SampleOutput, Submission, TokenLogprob
from scheduler_svc.core import admission
from scheduler_svc.core.admission import sample_index
from scheduler_svc.core.types import Request, RequestEvent


@dataclass
class Prompt:
    """One prompt as the caller gave it: `text` (None for token ids) and its token ids."""

    text: str | None
    token_ids: list[int]
    priority: int = 0
    images: tuple[ImageInput, ...] = ()  # a vision-language prompt's, over placeholders
    lora: LoraRef | None = None  # the LoRA adapter it runs with; None = the base model


@dataclass
class PreparedRequest:
    """One prompt ready to submit: the engine's core requests (one per sample)."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    core_requests: list[Request]
    n: int
    num_logprobs: int | None  # what the caller asked for (vLLM's), None = no logprobs


def prepare(
    request_id: str,
    prompt: Prompt,
    params: SamplingParams,
    limits: ModelLimits,
    grammars: GrammarCompiler,
    seed: int,
) -> PreparedRequest:
    """Raises ValueError with the servers' message for a request they would refuse.
    `seed` is used when `params.seed` is None."""
    options = params.options()
    grammar = ""
    if options.constraint is not None:
        grammar = grammars.compile(options.constraint, limits.vocab_size, limits.eos_token_ids)
    validated = validate(
        prompt.token_ids,
        options.sampling,
        options.stopping,
        options.num_logprobs,
        "",
        limits,
        n=options.n,
        priority=prompt.priority,
        grammar=grammar,
        options_checked=True,
    )
    submission = Submission.fresh(request_id, validated, seed)
    base = admission.core_request(request_spec(submission), limits.eos_token_ids, time.time())
    base.images = prompt.images
    base.lora = prompt.lora
    return PreparedRequest(
        request_id,
        prompt,
        params,
        admission.expand_samples(base, submission.n, {}),
        submission.n,
        params.logprobs,
    )


def request_spec(submission: Submission) -> admission.RequestSpec:
    """The core's door for a validated request, field for field what the router's
    `SubmitRequest` carries to a scheduler, with no protobuf in between."""
    sampling, stopping = submission.sampling, submission.stopping
    return admission.RequestSpec(
        request_id=submission.request_id,
        prompt_token_ids=submission.prompt_token_ids,
        seed=sampling.seed,
        max_tokens=stopping.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        repetition_penalty=sampling.repetition_penalty,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        min_tokens=stopping.min_tokens,
        stop_token_ids=stopping.stop_token_ids,
        ignore_eos=stopping.ignore_eos,
        num_logprobs=submission.num_logprobs,
        grammar=submission.grammar,
        priority=submission.priority,
    )


@dataclass
class _Sample:
    """One sample's output so far."""

    stream: SampleStream
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None


class _RequestState:
    def __init__(self, request: PreparedRequest, tokenizer: Tokenizer) -> None:
        self.request = request
        prompt_ids = request.prompt.token_ids
        self.samples = []
        for _ in range(request.n):
            stream = SampleStream(tokenizer, prompt_ids, _stop_strings(request.params))
            if not request.params.skip_special_tokens:
                stream.detokenizer = IncrementalDetokenizer(
                    tokenizer, prompt_ids, skip_special_tokens=False
                )
            self.samples.append(_Sample(stream))
        self.num_unfinished = request.n


class BatchSink:
    """The engine loop's sink for every request of one call (`RequestSink`); `deliver`
    and `fail` run on the engine thread, `wait` on the caller's. `abort(core_request_id)`
    stops a request in the engine (called on the engine thread)."""

    def __init__(
        self,
        requests: list[PreparedRequest],
        tokenizer: Tokenizer,
        abort: Callable[[str], None],
        on_request_done: Callable[[], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self._abort = abort
        self._on_request_done = on_request_done
        self.states = [_RequestState(r, tokenizer) for r in requests]
        self._by_core_id = {
            core.request_id: (state, sample_index(core.request_id, state.request.n))
            for state in self.states
            for core in state.request.core_requests
        }
        self._num_unfinished = len(self.states)
        self.error: str | None = None
        self._done = threading.Event()
        if not self.states:
            self._done.set()

    def deliver(self, events: list[RequestEvent]) -> None:
        for event in events:
            state, index = self._by_core_id[event.request_id]
            sample = state.samples[index]
            if sample.finish_reason is not None:
                continue
            if not state.request.params.detokenize:  # ids alone: no text, no stop strings
                sample.token_ids += [t.token_id for t in event.new_tokens]
                if event.finish_reason is not None:
                    self._finish(state, sample, FinishReason(event.finish_reason.value))
                continue
            with_logprobs = state.request.num_logprobs is not None
            output = SampleOutput(
                index,
                [t.token_id for t in event.new_tokens],
                FinishReason(event.finish_reason.value) if event.finish_reason else None,
                [(t.logprob, list(t.top_logprobs)) for t in event.new_tokens]
                if with_logprobs
                else [],
            )
            processed = sample.stream.process(output)
            assert processed is not None  # only a resume skips tokens
            token_ids, text, finish_reason, logprobs = processed
            sample.token_ids += token_ids
            sample.text.append(text)
            sample.logprobs += logprobs
            if finish_reason is None:
                continue
            if event.finish_reason is None:  # a stop string ended it: the engine runs on
                self._abort(event.request_id)
            self._finish(state, sample, finish_reason)
        if self._num_unfinished == 0:
            self._done.set()

    def _finish(self, state: _RequestState, sample: _Sample, reason: FinishReason) -> None:
        sample.finish_reason = reason
        state.num_unfinished -= 1
        if state.num_unfinished == 0:
            self._num_unfinished -= 1
            if self._on_request_done is not None:
                self._on_request_done()

    def fail(self, request_id: str, message: str) -> None:
        self.error = message
        self._done.set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once every request finished or one failed (`error`)."""
        return self._done.wait(timeout_s)

    def outputs(self) -> list[RequestOutput]:
        """The finished requests, in submission order."""
        return [self._request_output(state) for state in self.states]

    def _request_output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        completions = [
            self._completion(i, sample, request) for i, sample in enumerate(state.samples)
        ]
        return RequestOutput(
            request.request_id, request.prompt.text, list(request.prompt.token_ids), completions
        )

    def _completion(
        self, index: int, sample: _Sample, request: PreparedRequest
    ) -> CompletionOutput:
        logprobs = None
        cumulative = None
        if request.num_logprobs is not None:
            logprobs = [self._token_logprobs(lp, request.num_logprobs) for lp in sample.logprobs]
            cumulative = sum(lp.logprob for lp in sample.logprobs)
        reason = sample.finish_reason
        text = "".join(sample.text)
        matched = sample.stream.stop.matched_stop
        if matched is not None and request.params.include_stop_str_in_output:
            text += matched
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(sample.token_ids),
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=reason.value if reason is not None else None,
            stop_reason=_stop_reason(sample, request.params),
        )

    def _token_logprobs(self, lp: TokenLogprob, num_top: int) -> dict[int, Logprob]:
        """vLLM's shape: the chosen token, then the top `num_top` alternatives with ranks."""
        top = lp.top[:num_top]
        rank = next((i + 1 for i, t in enumerate(lp.top) if t.token_id == lp.token_id), None)
        entries = {
            lp.token_id: Logprob(
                lp.logprob, rank, self.tokenizer.decode([lp.token_id], skip_special_tokens=False)
            )
        }
        for i, t in enumerate(top):
            entries.setdefault(t.token_id, Logprob(t.logprob, i + 1, t.token))
        return entries


def _stop_strings(params: SamplingParams) -> list[str]:
    stop = params.stop
    return [stop] if isinstance(stop, str) else list(stop or [])


def _stop_reason(sample: _Sample, params: SamplingParams) -> int | str | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the sample."""
    if sample.finish_reason is not FinishReason.STOP:
        return None
    if sample.stream.stop.matched_stop is not None:
        return sample.stream.stop.matched_stop
    last = sample.token_ids[-1] if sample.token_ids else None
    return last if last is not None and last in (params.stop_token_ids or []) else None
