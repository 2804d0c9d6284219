"""Speculative decoding's configuration: vLLM's `--speculative-config` JSON (and
`LLM(speculative_config=...)`), read by the scheduler (its proposers,
scheduler_svc/core/spec_decode.py) and by the workers (a draft model, worker_svc/draft.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# vLLM's defaults for prompt lookup when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` / `LLM(speculative_config=...)` fields that apply."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    # draft_model: a smaller model with the served model's tokenizer (worker_svc/draft.py)
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # Suffix decoding (scheduler_svc/core/suffix_decoding.py), vLLM's fields and defaults.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not served: the methods "
                f"are {', '.join(METHODS)}"
            )
        if self.method == "suffix":
            self._check_suffix()
        if (self.method == "draft_model") != bool(self.model):
            raise ValueError(
                'a draft model needs "model": the draft\'s folder (or .gguf), '
                'and only method "draft_model" takes one'
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(
                "speculative decoding needs num_speculative_tokens >= 1 (the "
                "drafts verified per step)"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        low, high = low or high, high or low
        assert low is not None and high is not None
        if not 1 <= low <= high:
            raise ValueError(
                f"prompt_lookup_min {low} and prompt_lookup_max {high} must be 1 <= min <= max"
            )
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    def _check_suffix(self) -> None:
        if self.num_speculative_tokens == 0:  # vLLM's default: the tree decides, up to its depth
            object.__setattr__(self, "num_speculative_tokens", self.suffix_decoding_max_tree_depth)
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError(
                f"suffix_decoding_max_tree_depth {self.suffix_decoding_max_tree_depth} must be >= 1"
            )
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(
                f"suffix_decoding_max_cached_requests "
                f"{self.suffix_decoding_max_cached_requests} must be >= 0 (0: no "
                "tree over earlier requests)"
            )
        if self.suffix_decoding_max_spec_factor < 0:
            raise ValueError(
                f"suffix_decoding_max_spec_factor "
                f"{self.suffix_decoding_max_spec_factor} must be >= 0"
            )
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(
                f"suffix_decoding_min_token_prob "
                f"{self.suffix_decoding_min_token_prob} must be in [0, 1]"
            )

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
        if settings.get("model") and "method" not in settings:  # vLLM infers it so
            settings["method"] = "draft_model"
        if settings.pop("draft_tensor_parallel_size", 1) not in (1, None):
            raise ValueError(
                "draft_tensor_parallel_size must be 1: the draft runs whole on "
                "the rank that samples"
            )
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config fields {unknown}: the fields are {sorted(known)}"
            )
        return cls(**settings)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
