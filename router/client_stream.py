"""What one `Generate` client gets from its request's scheduler messages, message by message.

`ClientStream.process` runs inside the scheduler stream reader's pass over a step
(router/request_feed.py) for every output of this request: it detokenizes, checks stop
strings, records a sample a stop string ended, and returns the client's message, or None
when there is nothing to send yet (tokens the client already has on a resume, or tokens
held for `--stream-interval`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router import replay
from router.types import SampleOutput, TokenChunk, TokenLogprob, Usage


@dataclass
class _Held:
    """One sample's output not sent yet, under --stream-interval."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(
        self, token_ids: list[int], text: str, logprobs: list[TokenLogprob]
    ) -> tuple[list[int], str, list[TokenLogprob]]:
        self.token_ids += token_ids
        self.text += text
        self.logprobs += logprobs
        return self.token_ids, self.text, self.logprobs


class ClientStream:
    """One Generate call's samples. `done` once every sample finished (its last message was
    returned); `cut_short` when a stop string ended a sample its scheduler was still running."""

    def __init__(self, request_id: str, plan: replay.StreamPlan, stream_interval: int) -> None:
        self.request_id = request_id
        self.samples = plan.samples
        self.progress = plan.progress
        self.num_prompt_tokens = len(plan.submission.prompt_token_ids)
        self.stream_interval = stream_interval
        self.num_unfinished = sum(not s.finished for s in self.samples)
        self.cut_short = False
        self._held: dict[int, _Held] = {}  # per sample, tokens not sent yet (interval > 1)
        self.num_draft_tokens = self.num_accepted_tokens = 0  # speculative decoding

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    def process(self, output: SampleOutput) -> TokenChunk | None:
        """The client's message for one scheduler (or replayed) message of one sample."""
        index = output.index
        sample = self.samples[index]
        self.num_draft_tokens += output.num_draft_tokens
        self.num_accepted_tokens += output.num_accepted_tokens
        if sample.finished:
            return None  # a stop string ended this sample here; the rest is dropped
        processed = sample.process(output)
        if processed is None:
            return None  # tokens the client already has (a resume)
        token_ids, text, finish_reason, logprobs = processed
        if sample.finished:
            self.num_unfinished -= 1
            if not self.progress.samples[index].finished:
                self.progress.finish(index)
                self.cut_short = True
        done = self.num_unfinished == 0
        if self.stream_interval > 1:
            token_ids, text, logprobs = self._held.setdefault(index, _Held()).add(
                token_ids, text, logprobs
            )
            if len(token_ids) < self.stream_interval and not finish_reason and not done:
                return None
            del self._held[index]
        if not done:
            return TokenChunk(self.request_id, index, token_ids, text, logprobs, finish_reason)
        usage = Usage(
            self.num_prompt_tokens,
            sum(s.num_completion_tokens for s in self.samples),
            self.num_draft_tokens,
            self.num_accepted_tokens,
        )
        # The request's last message carries its usage.
        return TokenChunk(self.request_id, index, token_ids, text, logprobs, finish_reason, usage)
