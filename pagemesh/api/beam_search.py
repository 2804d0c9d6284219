"""Beam search as `transformers` runs it (`generate(num_beams=..., length_penalty=...)`),
driven one token at a time by whoever owns an engine: the offline `LLM.beam_search` and the
router's OpenAI `use_beam_search`.

Each round, every running beam is sent as a request for one token with its top
`num_candidates` alternatives (logprobs under the model's own distribution); `advance` takes
those alternatives and keeps what `transformers` keeps. The beams' KV is shared through the
prefix cache, as vLLM's beam search shares it: the blocks a beam's prefix fills are the
same blocks for every beam descended from it, and only the last, partial block is computed
again (at most block size - 1 tokens a beam a round).

What `transformers` does, and this does the same:
- the `num_candidates` = max(2, 1 + #EOS ids) x width best continuations over all beams, by
  accumulated logprob;
- a continuation ending in EOS, or reaching `max_tokens`, finishes, but only if it ranks in
  the top `width`; its score is its accumulated logprob / generated length ** length_penalty
  (the EOS counted); the best `width` finished ones are kept;
- the best `width` unfinished continuations are the next round's beams;
- `early_stopping` False (the default): stop when `width` beams have finished and the best
  running beam, scored at its current length, does not beat the worst of them; True: stop
  when `width` have finished; "never": score the running beam at `max_tokens` when
  length_penalty > 0.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pagemesh.api.options.validation import MAX_NUM_LOGPROBS

EarlyStopping = bool | Literal["never"]
# A round's alternatives for one beam: (token id, logprob), the most likely first.
Alternatives = Sequence[tuple[int, float]]


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: `beam_width` beams, up to `max_tokens` new tokens each;
    the `beam_width` best are returned. `temperature` must stay 0 (beam search does not
    sample); `early_stopping` is transformers' (vLLM has none: it behaves as False)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_beam_options(self.beam_width, self.max_tokens, self.temperature, self.early_stopping)


def check_beam_options(
    beam_width: int, max_tokens: int, temperature: float | None, early_stopping: EarlyStopping
) -> None:
    """ValueError for options beam search cannot run with, saying what to set."""
    if not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be an integer >= 1, got {beam_width!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if temperature:
        raise ValueError(
            f"beam search does not sample: leave temperature at 0 (got "
            f"{temperature}), or sample without beam search"
        )
    if early_stopping not in (True, False, "never"):
        raise ValueError(f'early_stopping must be true, false or "never", got {early_stopping!r}')


def num_candidates(beam_width: int, num_eos_ids: int) -> int:
    """Alternatives each beam is asked for a round: transformers' `beams_to_keep`."""
    return max(2, 1 + num_eos_ids) * beam_width


def check_num_candidates(search: BeamSearch, width_name: str) -> None:
    """ValueError when a round needs more alternatives per beam than the engine returns;
    `width_name` is what the caller set the width with (beam_width, best_of)."""
    needed = search.num_candidates
    if needed > MAX_NUM_LOGPROBS:
        raise ValueError(
            f"a beam width of {search.width} needs the {needed} most likely "
            f"tokens of each beam a round, and the engine returns at most "
            f"{MAX_NUM_LOGPROBS}: use {width_name} <= "
            f"{search.width * MAX_NUM_LOGPROBS // needed}"
        )


@dataclass
class Beam:
    """One sequence: its generated tokens, each one's logprob, and their sum."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # "stop" (an EOS id) or "length"; None while running
    score: float = 0.0  # a finished beam's: cumulative logprob / length ** length_penalty


class BeamSearch:
    """One prompt's search. `running` are the beams to send this round (their generated
    tokens follow the prompt); `advance` takes each one's alternatives; `done` says when to
    stop; `best(n)` are the results, best first."""

    def __init__(
        self,
        beam_width: int,
        max_tokens: int,
        eos_token_ids: Sequence[int],
        length_penalty: float = 1.0,
        early_stopping: EarlyStopping = False,
    ) -> None:
        check_beam_options(beam_width, max_tokens, 0.0, early_stopping)
        self.width = beam_width
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = num_candidates(beam_width, len(self.eos_token_ids))
        self.running: list[Beam] = [Beam()]
        self.finished: list[Beam] = []  # the best `width`, best first
        self.num_generated = 0
        self._improvable = True  # transformers' `is_early_stop_heuristic_unsatisfied`
        self.done = False

    def advance(self, alternatives: Sequence[Alternatives]) -> None:
        """One round: `alternatives[i]` are running beam i's next tokens, best first (at
        least `num_candidates` of them, or the whole vocabulary)."""
        if self.done:
            raise RuntimeError("this beam search is done")
        if len(alternatives) != len(self.running):
            raise ValueError(
                f"{len(alternatives)} beams' alternatives for {len(self.running)} running beams"
            )
        candidates = self._top_candidates(alternatives)
        last_round = self.num_generated + 1 >= self.max_tokens
        may_finish = self._may_finish()
        running: list[Beam] = []
        for rank, (total, beam, token, logprob) in enumerate(candidates):
            ends = last_round or token in self.eos_token_ids
            if not ends:
                if len(running) < self.width:
                    running.append(self._extended(beam, token, logprob, total))
            elif rank < self.width and may_finish:
                reason = "stop" if token in self.eos_token_ids else "length"
                self._finish(self._extended(beam, token, logprob, total), reason)
        self.num_generated += 1
        self.running = running
        self._improvable = self._improvable and self._may_improve()
        full = len(self.finished) == self.width and self.early_stopping is True
        self.done = last_round or not running or not self._improvable or full

    def best(self, n: int | None = None) -> list[Beam]:
        """The `n` (default: width) best finished beams, best first. Before the search is
        done, the running beams count as if they finished now (cut by length)."""
        beams = list(self.finished)
        if not self.done:
            for beam in self.running:
                scored = Beam(
                    beam.token_ids,
                    beam.logprobs,
                    beam.cumulative_logprob,
                    "length",
                    self._score(beam.cumulative_logprob, self.num_generated),
                )
                beams.append(scored)
            beams.sort(key=lambda b: -b.score)
        return beams[: self.width if n is None else n]

    def _top_candidates(
        self, alternatives: Sequence[Alternatives]
    ) -> list[tuple[float, Beam, int, float]]:
        """The best `num_candidates` (accumulated logprob, beam, token, logprob) over all
        beams, best first; ties to the earlier beam, then the more likely token (torch.topk
        keeps no order among ties: they are where two engines may differ)."""
        pool = (
            (beam.cumulative_logprob + logprob, index, order, beam, token, logprob)
            for index, (beam, options) in enumerate(zip(self.running, alternatives))
            for order, (token, logprob) in enumerate(options[: self.num_candidates])
        )
        best = heapq.nsmallest(self.num_candidates, pool, key=lambda c: (-c[0], c[1], c[2]))
        return [(total, beam, token, logprob) for total, _, _, beam, token, logprob in best]

    def _extended(self, beam: Beam, token: int, logprob: float, total: float) -> Beam:
        return Beam(beam.token_ids + [token], beam.logprobs + [logprob], total)

    def _score(self, cumulative_logprob: float, length: int) -> float:
        return cumulative_logprob / (length**self.length_penalty)

    def _may_finish(self) -> bool:
        """transformers adds no finished beam in a round begun with `width` finished under
        early_stopping=True."""
        return not (self.early_stopping is True and len(self.finished) == self.width)

    def _finish(self, beam: Beam, reason: str) -> None:
        beam.finish_reason = reason
        beam.score = self._score(beam.cumulative_logprob, len(beam.token_ids))
        self.finished.append(beam)
        # Stable: among equal scores the one finished first stays ahead (torch.topk over
        # [kept, new] as transformers merges them).
        self.finished.sort(key=lambda b: -b.score)
        del self.finished[self.width :]

    def _may_improve(self) -> bool:
        """Whether the best running beam could still beat the worst finished one."""
        if len(self.finished) < self.width:
            return True
        if not self.running:
            return False
        length = self.num_generated
        if self.early_stopping == "never" and self.length_penalty > 0:
            length = self.max_tokens
        best_possible = self._score(self.running[0].cumulative_logprob, length)
        return best_possible > self.finished[-1].score
