"""Speculative decoding's configuration and the scheduler's draft proposers.

The scheduler proposes drafts itself, from each request's own tokens, and sends them in the
step message (`CachedRequestData.spec_token_ids`): no second round trip, and the workers
need nothing but the drafts. They verify them by drawing the token decoding without drafts
would draw at each drafted position (worker_svc/spec_verify.py), so the output equals
decoding without speculation token for token, seeded draws included, and only the step's
cost changes.

`ngram` (vLLM's prompt lookup): the longest n-gram of `prompt_lookup_min..max` tokens ending
the request's tokens that occurred before in them; the tokens that followed its latest
occurrence are the drafts. A request's draft length adapts (halved after a step that kept
none of its drafts, doubled back after one that kept all), so text with nothing to copy
costs little: a rejected draft is one more row of the step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

METHODS = ("ngram",)
# vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` / `LLM(speculative_config=...)` fields that apply."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not served: the methods "
                             f"are {', '.join(METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative decoding needs num_speculative_tokens >= 1 (the "
                             "drafts verified per step)")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = low or high, high or low
        assert low is not None and high is not None
        if not 1 <= low <= high:
            raise ValueError(f"prompt_lookup_min {low} and prompt_lookup_max {high} must be "
                             "1 <= min <= max")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """From vLLM's JSON (or a dict); None for none. Fields vLLM has that pagemesh does
        not serve are named in the error, with what to use."""
        if value is None or value == "" or value == {}:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError("the speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        settings = dict(value)
        if "model" in settings and "method" not in settings:
            raise ValueError("draft-model speculation (a 'model') is not served yet: use "
                             "\"method\": \"ngram\"")
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"unknown speculative config fields {unknown}: the fields are "
                             f"{sorted(known)}")
        return cls(**settings)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class NgramProposer:
    """Prompt-lookup drafts per request, over a numpy copy of its tokens kept up to date
    incrementally (a request's tokens only grow; a shorter list starts it over)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._tokens: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}
        self._budget: dict[str, int] = {}  # each request's draft length now

    def max_drafts(self, request_id: str) -> int:
        return self._budget.get(request_id, self.config.num_speculative_tokens)

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int],
                max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens that followed the longest earlier occurrence of the
        tokens' ending n-gram; none when there is none."""
        if max_drafts <= 0:
            return []
        tokens = self._updated(request_id, prompt, output)
        n = len(tokens)
        last = tokens[n - 1]
        # Positions whose token equals the last one, extended backwards one token at a time.
        candidates = np.flatnonzero(tokens[: n - 1] == last)
        matched = 1
        while candidates.size and matched < self.config.prompt_lookup_max:
            room = candidates[candidates >= matched]  # a match cannot start before 0
            longer = room[tokens[room - matched] == tokens[n - 1 - matched]]
            if not longer.size:
                break
            candidates, matched = longer, matched + 1
        if not candidates.size or matched < self.config.prompt_lookup_min:
            return []
        start = int(candidates[-1]) + 1
        return tokens[start : start + max_drafts].tolist()

    def observe(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A step's verdict on a request's drafts: its draft length halves when none held,
        and doubles back (to num_speculative_tokens) when all did."""
        if num_drafts <= 0:
            return
        budget = self.max_drafts(request_id)
        if num_accepted == 0:
            budget = max(1, budget // 2)
        elif num_accepted == num_drafts:
            budget = min(self.config.num_speculative_tokens, budget * 2)
        self._budget[request_id] = budget

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
        self._lengths.pop(request_id, None)
        self._budget.pop(request_id, None)

    def _updated(self, request_id: str, prompt: Sequence[int], output: Sequence[int]
                 ) -> np.ndarray:
        total = len(prompt) + len(output)
        buffer = self._tokens.get(request_id)
        known = self._lengths.get(request_id, 0)
        if buffer is None or known > total or known < len(prompt):
            buffer = np.empty(max(2 * total, 64), dtype=np.int64)
            buffer[: len(prompt)] = prompt
            known = len(prompt)
        if total > buffer.shape[0]:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:known] = buffer[:known]
            buffer = grown
        if total > known:
            buffer[known:total] = output[known - len(prompt) :]
        self._tokens[request_id], self._lengths[request_id] = buffer, total
        return buffer[:total]
