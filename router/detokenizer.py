"""Incremental detokenization: token ids in, new text out, never a broken character.

The technique is vLLM's and TGI's. Each step decodes a short window of ids twice, once
ending before the new token (`prefix_offset:read_offset`) and once including it
(`prefix_offset:`), and emits the difference. Decoding a window rather than one token keeps
what a token means in context (a SentencePiece leading space, bytes of a character split
across tokens); decoding a window rather than everything keeps each step O(1).
While the decoded window ends in U+FFFD a character is still incomplete, so nothing is
emitted and the offsets stay put until a later token completes it (or `flush`).
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context, like vLLM: enough for a leading space or a split character.
_NUM_PROMPT_CONTEXT_TOKENS = 5


class SupportsDecode(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, chunk by chunk.

    Invariant: the chunks returned by `add` and then `flush` concatenate to
    `decode(prompt_context + output_ids)[len(decode(prompt_context)):]`, which for byte-level
    BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) is exactly `tokenizer.decode(output_ids)`.
    For SentencePiece tokenizers the difference is a leading space that `decode` alone would
    strip and that belongs in a continuation (" Paris" after "The capital is").
    No chunk from `add` ends with an incomplete UTF-8 character.
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._token_ids: list[int] = list(context)
        self._num_context_tokens = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self._num_context_tokens

    def add(self, token_ids: list[int]) -> str:
        """Append output token ids; return only the text they complete (may be "")."""
        chunks = []
        for token_id in token_ids:
            self._token_ids.append(token_id)
            chunks.append(self._emit(final=False))
        return "".join(chunks)

    def flush(self) -> str:
        """Return the text still held back (an incomplete character comes out as U+FFFD).

        Call once when the request ends; `add` may still be called afterwards.
        """
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if not final and new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


def _prompt_context(
    tokenizer: SupportsDecode, prompt_token_ids: list[int], skip_special_tokens: bool
) -> list[int]:
    """The last few prompt ids, or none when the prompt ends inside a character: output bytes
    completing that character would otherwise be attributed to the prompt."""
    context = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
    if tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(
        _REPLACEMENT_CHAR
    ):
        return []
    return context
