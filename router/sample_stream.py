"""One sample's text as the client sees it: incremental detokenization, stop strings, count."""

from __future__ import annotations

from typing import Any

from protos.pagemesh.v1 import generate_pb2
from router import convert
from router.detokenizer import IncrementalDetokenizer
from router.stop import StopChecker
from router.tokenizer import Tokenizer

Processed = tuple[list[int], str, int, list[generate_pb2.TokenLogprob]]


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

    def process(self, chunk: Any) -> Processed | None:
        """(new token ids, new text, finish reason, logprobs) of one scheduler message;
        None when the whole message was skipped (nothing new for the client)."""
        if self.num_tokens_to_skip and chunk.token_ids:
            num_skipped = min(self.num_tokens_to_skip, len(chunk.token_ids))
            self.num_tokens_to_skip -= num_skipped
            self.prime(list(chunk.token_ids[:num_skipped]))
            chunk = convert.without_leading_tokens(chunk, num_skipped)
            if not chunk.token_ids and chunk.finish_reason == convert.FINISH_REASON_UNSPECIFIED:
                return None
        token_ids = list(chunk.token_ids)
        self.num_completion_tokens += len(token_ids)
        finish_reason = chunk.finish_reason
        text, stopped = self.stop.feed(self.detokenizer.add(token_ids))
        if not stopped and finish_reason != convert.FINISH_REASON_UNSPECIFIED:
            tail, stopped = self.stop.feed(self.detokenizer.flush())
            text += tail
            if not stopped:
                text += self.stop.flush()
        if stopped:
            finish_reason = convert.FINISH_REASON_STOP
        self.finished = finish_reason != convert.FINISH_REASON_UNSPECIFIED
        logprobs = convert.token_logprobs(chunk, self._token_texts(chunk)) if chunk.logprobs else []
        return token_ids, text, finish_reason, logprobs

    def _token_texts(self, chunk: Any) -> dict[int, str]:
        ids = {t.token_id for lp in chunk.logprobs for t in lp.top}
        ids.update(chunk.token_ids)
        return {i: self.tokenizer.decode([i], skip_special_tokens=False) for i in ids}
