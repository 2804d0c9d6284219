"""Named benchmark workloads: fixed-seed lists of (prompt token ids, max_tokens).

Prompts are random token ids, never text: the figures then measure the engine, not a
tokenizer, and the same workload can be sent to any engine that takes token ids. Every
builder is a pure function of its arguments, so two runs (or two engines) given the same
name, overrides and seed get the very same requests.

- `w64`: 64 requests x 128 prompt ids x 128 new tokens. Its prompts are exactly
  bench/common.py's `w64_workload` (random.Random(0), one list per request,
  randrange(1, 32000)), so `pagemesh bench` figures compare with the older scripts'.
- `sharegpt-like`: prompt and output lengths log-normal, shaped like the ShareGPT
  conversations vLLM's serving benchmark replays (long right tail, many short turns).
- `shared-prefix`: multi-tenant system prompts; each request is its tenant's fixed prefix
  plus a short unique suffix, which is what a prefix cache is for.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# w64's ids are drawn below this bound whatever the served vocabulary (when that is larger),
# so that the prompts stay bench/common.py's.
W64_ID_BOUND = 32000
DEFAULT_VOCAB_SIZE = 32000


@dataclass(frozen=True)
class LogNormal:
    """Lengths drawn as round(lognormvariate(ln(median), sigma)), clipped to [low, high]."""

    median: int
    sigma: float
    low: int
    high: int

    def scaled(self, median: int) -> LogNormal:
        """The same shape around another median; the upper clip moves with it."""
        high = max(self.low, round(self.high * median / self.median))
        return LogNormal(median, self.sigma, self.low, high)

    def draw(self, rng: random.Random) -> int:
        value = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(self.high, max(self.low, value))


# ShareGPT-like shape: prompts median 200 tokens (p90 ~ 640 before the clip), outputs median
# 150 (p90 ~ 420). Sigmas chosen so the clipped tails hold a few percent of requests.
SHAREGPT_PROMPT = LogNormal(median=200, sigma=0.9, low=4, high=1024)
SHAREGPT_OUTPUT = LogNormal(median=150, sigma=0.8, low=4, high=512)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # tokens to generate; EOS is ignored, so exactly this many come back


@dataclass(frozen=True)
class Workload:
    name: str  # the workload's name, as RunResult.workload
    requests: list[BenchRequest]
    description: str  # one line: its parameters, for report headers

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)


def _random_ids(rng: random.Random, num_tokens: int, id_bound: int) -> list[int]:
    # Id 0 is left out: in many vocabularies it is a special token (tests' tiny models: EOS).
    return [rng.randrange(1, id_bound) for _ in range(num_tokens)]


def w64(
    num_requests: int = 64,
    prompt_len: int = 128,
    max_tokens: int = 128,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """bench/common.py's W64 prompts (with its defaults and a vocabulary >= 32000)."""
    rng = random.Random(seed)
    bound = min(vocab_size, W64_ID_BOUND)
    requests = [
        BenchRequest(_random_ids(rng, prompt_len, bound), max_tokens) for _ in range(num_requests)
    ]
    return Workload(
        "w64",
        requests,
        f"{num_requests} requests x {prompt_len} random prompt ids "
        f"x {max_tokens} new tokens (seed {seed})",
    )


def sharegpt_like(
    num_requests: int = 128,
    prompt_len: int | None = None,
    max_tokens: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> Workload:
    """`prompt_len` / `max_tokens` move the medians of SHAREGPT_PROMPT / SHAREGPT_OUTPUT."""
    prompt_shape = SHAREGPT_PROMPT.scaled(prompt_len) if prompt_len else SHAREGPT_PROMPT
    output_shape = SHAREGPT_OUTPUT.scaled(max_tokens) if max_tokens else SHAREGPT_OUTPUT
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        num_prompt, num_output = prompt_shape.draw(rng), output_shape.draw(rng)
        requests.append(BenchRequest(_random_ids(rng, num_prompt, vocab_size), num_output))
    return Workload(
        "sharegpt-like",
        requests,
        f"{num_requests} requests, log-normal lengths: prompt median {prompt_shape.median} "
        f"sigma {prompt_shape.sigma} in [{prompt_shape.low}, {prompt_shape.high}], output median "
        f"{output_shape.median} sigma {output_shape.sigma} in [{output_shape.low}, "
        f"{output_shape.high}] (seed {seed})",
    )


def shared_prefix(
    num_requests: int = 64,
    prompt_len: int = 512,
    max_tokens: int = 64,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    num_tenants: int = 4,
    suffix_len: tuple[int, int] = (32, 64),
) -> Workload:
    """`prompt_len` is each tenant's system prefix; requests pick a tenant at random."""
    if num_tenants < 1:
        raise ValueError(f"num_tenants must be >= 1, got {num_tenants}")
    rng = random.Random(seed)
    prefixes = [_random_ids(rng, prompt_len, vocab_size) for _ in range(num_tenants)]
    requests = []
    for _ in range(num_requests):
        prefix = prefixes[rng.randrange(num_tenants)]
        suffix = _random_ids(rng, rng.randint(*suffix_len), vocab_size)
        requests.append(BenchRequest(prefix + suffix, max_tokens))
    return Workload(
        "shared-prefix",
        requests,
        f"{num_requests} requests, {num_tenants} tenants x {prompt_len}-token system prefix + "
        f"{suffix_len[0]}-{suffix_len[1]} unique tokens, {max_tokens} new tokens (seed {seed})",
    )


WORKLOADS = {"w64": w64, "sharegpt-like": sharegpt_like, "shared-prefix": shared_prefix}


def build_workload(
    name: str,
    *,
    num_requests: int | None = None,
    prompt_len: int | None = None,
    max_tokens: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    num_tenants: int | None = None,
) -> Workload:
    """The named workload; None leaves that parameter at the workload's default."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    for flag, value in (
        ("num_requests", num_requests),
        ("prompt_len", prompt_len),
        ("max_tokens", max_tokens),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    overrides = {
        k: v
        for k, v in (
            ("num_requests", num_requests),
            ("prompt_len", prompt_len),
            ("max_tokens", max_tokens),
        )
        if v is not None
    }
    if num_tenants is not None:
        if name != "shared-prefix":
            raise ValueError("num_tenants applies to the shared-prefix workload only")
        overrides["num_tenants"] = num_tenants
    return WORKLOADS[name](vocab_size=vocab_size, seed=seed, **overrides)


def poisson_arrivals(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: 0 for the first request, then exponential gaps
    of mean 1 / request_rate drawn from their own `random.Random(seed)`, so the arrival
    pattern does not depend on the workload's draws."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.expovariate(request_rate)
        times.append(now)
    return times
