"""One sample's text as the client sees it: incremental detokenization, stop strings, count."""

from __future__ import annotations

import dataclasses

from pagemesh.runtime.tokenizer import Tokenizer
from router.detokenizer import IncrementalDetokenizer
from router.stop import StopChecker
from router.types import FinishReason, SampleOutput, TokenLogprob, TopLogprob

Processed = tuple[list[int], str, FinishReason | None, list[TokenLogprob]]


class SampleStream:
    """Turns one sample's scheduler messages into (token ids, text, finish reason, logprobs).

    Resuming a stream the client already partly has: `prime(ids)` runs tokens the client has
    through the detokenizer and the stop checker without emitting their text, so what follows
    decodes and stops exactly as in the unbroken stream; `num_tokens_to_skip` does the same
    with the first tokens of the messages still to come (the client has more than the
    checkpoint held). Either way the tokens count in `num_completion_tokens`.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stop = StopChecker(stop)
        self.num_completion_tokens = 0
        self.num_tokens_to_skip = 0
        self.finished = False

    def prime(self, token_ids: list[int], final: bool = False) -> None:
        """Advances past tokens the client already has; `final`: its last message too (the
        text held back for a possible stop string went out with it)."""
        self.num_completion_tokens += len(token_ids)
        _, stopped = self.stop.feed(self.detokenizer.add(token_ids))
        if final and not stopped:
            self.stop.feed(self.detokenizer.flush())
            self.stop.flush()

    def process(self, output: SampleOutput) -> Processed | None:
        """(new token ids, new text, finish reason, logprobs) of one scheduler message;
        None when the whole message was skipped (nothing new for the client)."""
        if self.num_tokens_to_skip and output.token_ids:
            num_skipped = min(self.num_tokens_to_skip, len(output.token_ids))
            self.num_tokens_to_skip -= num_skipped
            self.prime(output.token_ids[:num_skipped])
            output = dataclasses.replace(
                output,
                token_ids=output.token_ids[num_skipped:],
                logprobs=output.logprobs[num_skipped:],
            )
            if not output.token_ids and output.finish_reason is None:
                return None
        token_ids = output.token_ids
        self.num_completion_tokens += len(token_ids)
        finish_reason = output.finish_reason
        text, stopped = self.stop.feed(self.detokenizer.add(token_ids))
        if not stopped and finish_reason is not None:
            tail, stopped = self.stop.feed(self.detokenizer.flush())
            text += tail
            if not stopped:
                text += self.stop.flush()
        if stopped:
            finish_reason = FinishReason.STOP
        self.finished = finish_reason is not None
        logprobs = self._token_logprobs(output) if output.logprobs else []
        return token_ids, text, finish_reason, logprobs

    def _token_logprobs(self, output: SampleOutput) -> list[TokenLogprob]:
        """Per-token logprobs with each token's text (the chosen ones and the alternatives)."""
        ids = {token_id for _, top in output.logprobs for token_id, _ in top}
        ids.update(output.token_ids)
        text = {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}
        return [
            TokenLogprob(token_id, logprob, [TopLogprob(i, lp, text[i]) for i, lp in top])
            for token_id, (logprob, top) in zip(output.token_ids, output.logprobs)
        ]
