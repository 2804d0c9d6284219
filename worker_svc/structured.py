"""Structured output on the sampling rank: each constrained request's grammar matcher, and
the masks they give the sampler.

A request's grammar comes compiled and checked by the router (llguidance's format, in
`SamplingParams.grammar`). Its matcher is not told which tokens were sampled: before every
draw it is brought up to the request's output as the runner knows it, however the tokens
got there — sampled here, sent by the scheduler, or carried in by a resumed or preempted
request rebuilt from its outputs. So a request resumed anywhere continues inside its
grammar exactly where it was, and the mask depends only on (grammar, output so far).

Masks are computed for the whole batch at once, in parallel on llguidance's own threads
(outside the GIL), as bits, and applied to the logits as bits by a C kernel (torch ops on
other devices): no Python loop over the vocabulary, no unpacked copy of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
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
    """llguidance's view of this model's vocabulary (slow to build, so once, on the first
    constrained request), its EOS ids, and the matchers' thread pool."""

    model_path: str
    vocab_size: int  # the logits' width
    eos_token_ids: tuple[int, ...]
    _tokenizer: object | None = None
    _executor: object | None = None
    _mask_thread: ThreadPoolExecutor | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def tokenizer(self) -> object:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _load_llguidance_tokenizer(
                    self.model_path, self.vocab_size, list(self.eos_token_ids)
                )
            return self._tokenizer

    def executor(self) -> object:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
        return self._executor

    def mask_thread(self) -> ThreadPoolExecutor:
        """Where a step's masks are computed while its forward runs (one thread: a
        matcher is only ever used by one step at a time)."""
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._mask_thread

    def new_state(self, grammar: str) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():  # the router checked it: a different llguidance, a bug
            raise ValueError(f"the request's grammar does not compile here: {matcher.get_error()}")
        return GrammarState(matcher)


def _load_llguidance_tokenizer(
    model_path: str, vocab_size: int, eos_token_ids: list[int]
) -> object:
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
    """A batch row whose draw is constrained: its state and the request's output so far;
    with speculative decoding, its drafts, each verified on the row after (row + j + 1 is
    drawn under the grammar as it stands once drafts[:j + 1] are output)."""

    row: int
    state: GrammarState
    output_token_ids: Sequence[int]
    draft_token_ids: Sequence[int] = ()

    @property
    def rows(self) -> range:
        return range(self.row, self.row + 1 + len(self.draft_token_ids))


def token_bitmask(vocabulary: GrammarVocabulary, rows: Sequence[ConstrainedRow]) -> torch.Tensor:
    """int32 [mask rows, ceil(vocab_size / 32)]: the tokens each row (and each draft's row
    after it) may draw next, as llguidance writes them (token i is bit i % 32 of word
    i // 32); the sampler applies them to the logits as they are
    (kernels/cpu_fused.apply_token_bitmask_). Each matcher first consumes the row's output
    tokens it has not seen yet; its drafts are consumed only to compute their rows' masks,
    and left unconsumed (llguidance rolls them back), so a rejected draft leaves no trace."""
    for constrained in rows:
        _catch_up(constrained, vocabulary.eos_token_ids)
    words = (vocabulary.vocab_size + 31) // 32
    starts, num_rows = [], 0
    for constrained in rows:
        starts.append(num_rows)
        num_rows += len(constrained.rows)
    bits = torch.zeros((num_rows, words), dtype=torch.int32)
    live = [(c, start) for c, start in zip(rows, starts) if not c.state.failed]
    executor = vocabulary.executor()
    if any(c.draft_token_ids for c, _ in live):
        executor.unsafe_compute_mask_ptr_with_draft_token(  # type: ignore[attr-defined]
            [(c.state.matcher, start, list(c.draft_token_ids)) for c, start in live],
            bits.data_ptr(),
            words * 4,
            num_rows,
        )
    elif live:
        executor.unsafe_compute_mask_ptr(  # type: ignore[attr-defined]
            [(c.state.matcher, start) for c, start in live], bits.data_ptr(), words * 4, num_rows
        )
    words_u32 = bits.numpy().view(np.uint32)  # the same memory, bit 31 without sign trouble
    for constrained, start in zip(rows, starts):
        for i in range(start, start + len(constrained.rows)):
            # A failed output allows only EOS; so does a row after a draft the grammar
            # refuses (it is never kept: that draft is rejected), rather than no token.
            if constrained.state.failed or not words_u32[i].any():
                words_u32[i] = 0
                for eos in vocabulary.eos_token_ids:
                    words_u32[i, eos // 32] |= np.uint32(1 << (eos % 32))
    return bits


@dataclass
class PendingMasks:
    """A step's masks being computed (token_bitmask on the mask thread) while the forward
    runs: they depend only on the tokens known when the step began. The runner waits for
    them before sampling, and in any case before its next step (`settle`), so no matcher is
    ever used by two steps at once."""

    rows: list[int]
    bits: Future[torch.Tensor]

    @classmethod
    def start(cls, vocabulary: GrammarVocabulary, rows: list[ConstrainedRow]) -> PendingMasks:
        return cls(
            [row for c in rows for row in c.rows],
            vocabulary.mask_thread().submit(token_bitmask, vocabulary, rows),
        )

    def settle(self) -> None:
        """Returns once the computation has ended (its error, if any, left to `result`)."""
        wait([self.bits])


def _catch_up(constrained: ConstrainedRow, eos_token_ids: tuple[int, ...]) -> None:
    state = constrained.state
    new = list(constrained.output_token_ids[state.num_consumed :])
    if not new or state.failed:
        return
    if not state.matcher.consume_tokens(new):  # type: ignore[attr-defined]
        state.failed = True
        logger.error(
            "a constrained request's output left its grammar after %d tokens (%s); "
            "only EOS is allowed from now",
            state.num_consumed,
            state.matcher.get_error(),
        )  # type: ignore[attr-defined]
    state.num_consumed += len(new)
