"""What `LLM.generate` and `LLM.chat` return, in vLLM's shapes and names, so that a vLLM
script reads them unchanged: a `RequestOutput` per prompt, holding a `CompletionOutput` per
sample (`SamplingParams.n`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    """One token's log probability (natural log, under the model's unmodified distribution).
    `rank`: 1 for the most likely token; None when the token was not among the top
    alternatives returned (the engine does not compute its rank then)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob, the chosen token first, then the alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One sample of a prompt.

    - index: which sample, 0..n-1;
    - text: the generated text (stop strings cut off, special tokens left out unless
      `skip_special_tokens=False`);
    - token_ids: the generated token ids (the stop string's tokens included, as in vLLM);
    - cumulative_logprob: sum of the chosen tokens' logprobs; None without `logprobs`;
    - logprobs: per token, its logprob and its `logprobs` most likely alternatives; None
      without `logprobs`;
    - finish_reason: "stop" (EOS, a stop token id or string), "length" (max_tokens or the
      end of the context) or "abort";
    - stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One prompt's outputs.

    - request_id: this LLM's id for the request ("0", "1", ... in submission order);
    - prompt: the prompt text (for token-id prompts, None; for chats, the rendered template);
    - prompt_token_ids: the prompt's token ids (what the model saw);
    - outputs: one CompletionOutput per sample, by index;
    - finished: always True here (generate returns finished requests).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: None = None  # vLLM's prompt logprobs are not computed
