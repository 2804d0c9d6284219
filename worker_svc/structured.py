"""Structured output on the sampling rank: each constrained request's grammar matcher, and
the masks they give the sampler.

A request's grammar comes compiled and checked by the router (llguidance's format, in
`SamplingParams.grammar`). Its matcher is not told which tokens were sampled: before every
draw it is brought up to the request's output as the runner knows it, however the tokens
got there — sampled here, sent by the scheduler, or carried in by a resumed or preempted
request rebuilt from its outputs. So a request resumed anywhere continues inside its
grammar exactly where it was, and the mask depends only on (grammar, output so far).

Masks are computed for the whole batch at once, in parallel on llguidance's own threads
(outside the GIL), as bits, then unpacked to the logits' width with numpy: no Python loop
over the vocabulary.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclass
class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    matcher: object  # llguidance.LLMatcher
    num_consumed: int = 0
    failed: bool = False  # the output left the grammar (never expected): only EOS from now


@dataclass
class GrammarVocabulary:
    """llguidance's view of this model's vocabulary (~1 s to build, so once, on the first
    constrained request), its EOS ids, and the matchers' thread pool."""

    model_path: str
    vocab_size: int  # the logits' width
    eos_token_ids: tuple[int, ...]
    _tokenizer: object | None = None
    _executor: object | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def tokenizer(self) -> object:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _load_llguidance_tokenizer(
                    self.model_path, self.vocab_size, list(self.eos_token_ids))
            return self._tokenizer

    def executor(self) -> object:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def new_state(self, grammar: str) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():  # the router checked it: a different llguidance, a bug
            raise ValueError(f"the request's grammar does not compile here: {matcher.get_error()}")
        return GrammarState(matcher)


def _load_llguidance_tokenizer(model_path: str, vocab_size: int, eos_token_ids: list[int]) -> object:
    """From the model's own tokenizer: the folder's tokenizer files, or a GGUF's vocabulary
    (which transformers converts)."""
    import llguidance.hf
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.is_file():  # .gguf
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos_token_ids or None)


@dataclass(frozen=True)
class ConstrainedRow:
    """A batch row whose draw is constrained: its state and the request's output so far."""

    row: int
    state: GrammarState
    output_token_ids: Sequence[int]


def allowed_tokens(vocabulary: GrammarVocabulary, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
    """[len(rows), vocab_size] bool: the tokens each row may draw next. Each matcher first
    consumes the row's output tokens it has not seen yet."""
    for constrained in rows:
        _catch_up(constrained, vocabulary.eos_token_ids)
    words = (vocabulary.vocab_size + 31) // 32
    bits = torch.zeros((len(rows), words), dtype=torch.int32)
    live = [(c.state.matcher, i) for i, c in enumerate(rows) if not c.state.failed]
    if live:
        vocabulary.executor().unsafe_compute_mask_ptr(  # type: ignore[attr-defined]
            live, bits.data_ptr(), words * 4, len(rows))
    allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
    allowed = torch.from_numpy(allowed[:, :vocabulary.vocab_size]).bool()
    for i, constrained in enumerate(rows):
        if constrained.state.failed:
            allowed[i] = False
            allowed[i, list(vocabulary.eos_token_ids)] = True
    return allowed


def _catch_up(constrained: ConstrainedRow, eos_token_ids: tuple[int, ...]) -> None:
    state = constrained.state
    new = list(constrained.output_token_ids[state.num_consumed:])
    if not new or state.failed:
        return
    if not state.matcher.consume_tokens(new):  # type: ignore[attr-defined]
        state.failed = True
        logger.error("a constrained request's output left its grammar after %d tokens (%s); "
                     "only EOS is allowed from now", state.num_consumed,
                     state.matcher.get_error())  # type: ignore[attr-defined]
    state.num_consumed += len(new)
