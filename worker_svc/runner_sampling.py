"""Sampling on the last stage's driver, a part of `ModelRunner` (runner.py): the structured
output masks of a step's constrained rows, started on the mask thread so that they are
computed while the forward runs (structured.py), then each request's token and the tokens
of its accepted drafts (sampler.py, spec_verify.py)."""

from __future__ import annotations

import torch

from protos.step import SampledToken
from worker_svc import sampler
from worker_svc.batch import RequestState
from worker_svc.loader import ModelMetadata
from worker_svc.spec_verify import accept_drafts, sampling_rows
from worker_svc.structured import ConstrainedRow, GrammarVocabulary, PendingMasks


class SamplingMixin:
    """`ModelRunner`'s sampling; its constructor sets the state below."""

    requests: dict[str, RequestState]
    metadata: ModelMetadata
    grammar_vocabulary: GrammarVocabulary | None  # made at the first constrained request

    def _start_masks(self, request_ids: list[str]) -> PendingMasks | None:
        """The constrained rows' masks, started on the mask thread so that they are computed
        while the forward runs; None when no row is constrained."""
        constrained: list[ConstrainedRow] = []
        for row, request_id in enumerate(request_ids):
            if row and request_ids[row - 1] == request_id:
                continue  # a draft's row: its mask comes with its request's first row
            state = self.requests[request_id]
            if state.sampling.grammar:
                if state.grammar is None:
                    state.grammar = self._grammar_vocabulary().new_state(state.sampling.grammar)
                constrained.append(
                    ConstrainedRow(
                        row,
                        state.grammar,
                        state.token_ids[state.num_prompt_tokens :],
                        state.draft_token_ids,
                    )
                )
        return PendingMasks.start(self._grammar_vocabulary(), constrained) if constrained else None

    def _sample(
        self, logits: torch.Tensor, request_ids: list[str], pending: PendingMasks | None
    ) -> tuple[dict[str, SampledToken], dict[str, list[SampledToken]]]:
        """Each request's token, and the tokens of its accepted drafts (spec_verify.py)."""
        masks = None if pending is None else sampler.RowMasks(pending.rows, pending.bits.result())
        tokens = sampler.sample(logits, sampling_rows(self.requests, request_ids), masks)
        return accept_drafts(self.requests, request_ids, tokens)

    def _grammar_vocabulary(self) -> GrammarVocabulary:
        """Made at the first constrained request (structured output is opt-in per request)."""
        if self.grammar_vocabulary is None:
            self.grammar_vocabulary = GrammarVocabulary(
                self.metadata.path, self.metadata.vocab_size, self.metadata.eos_token_ids
            )
        return self.grammar_vocabulary
