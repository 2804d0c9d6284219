"""Drives a workload against a target, closed or open loop, and turns timings into RunResults.

- Closed loop (`concurrency` N > 0, no rate): N requests in flight at all times until the
  workload runs out; N = 0 sends every request at once.
- Open loop (`request_rate` R > 0): requests start at Poisson times (`poisson_arrivals`,
  from a fixed seed) whether or not earlier ones finished; `concurrency` > 0 then caps how
  many are in flight, the rest wait for a slot (their clock starts when they are sent).

Samples, per successful request: TTFT = send -> first token; ITL = every gap between
consecutive tokens (a chunk of k tokens adds k - 1 zero gaps, so a request of n tokens
gives exactly n - 1 ITL samples); E2E = send -> last token. A failed request adds no
samples and counts in `num_errors`; `num_requests` counts the requests that completed, so
requests/s is what was served. The duration is the first send to the last completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagemesh.tools.loadgen.client import Arrivals, Driver, ModelInfo, Target, open_driver
from pagemesh.tools.loadgen.result import RunResult
from pagemesh.tools.loadgen.workloads import BenchRequest, Workload, poisson_arrivals

MAX_ERRORS_IN_NOTES = 3


@dataclass(frozen=True)
class Level:
    """One point of a sweep: requests in flight at most (0 = no cap) and Poisson arrivals
    per second (0 = closed loop)."""

    concurrency: int = 0
    request_rate: float = 0.0

    def __post_init__(self) -> None:
        if self.concurrency < 0:
            raise ValueError(f"concurrency must be >= 0, got {self.concurrency}")
        if self.request_rate < 0:
            raise ValueError(f"request_rate must be >= 0, got {self.request_rate}")

    def describe(self) -> str:
        if self.request_rate:
            cap = f", <= {self.concurrency} in flight" if self.concurrency else ""
            return f"{self.request_rate:g} req/s{cap}"
        return f"concurrency {self.concurrency or 'all'}"


@dataclass
class Outcome:
    request: BenchRequest
    start_s: float = 0.0
    arrivals: Arrivals | None = None
    error: str | None = None


def token_samples(start_s: float, arrivals: Arrivals) -> tuple[float, list[float], float]:
    """(TTFT, inter-token gaps, E2E) in seconds of one request sent at `start_s`."""
    first_at, first_count = arrivals[0]
    gaps = [0.0] * (first_count - 1)
    previous = first_at
    for at, count in arrivals[1:]:
        gaps.append(at - previous)
        gaps.extend([0.0] * (count - 1))
        previous = at
    return first_at - start_s, gaps, previous - start_s


def summarize(
    outcomes: list[Outcome],
    duration_s: float,
    engine: str,
    workload: str,
    dtype: str,
    level: Level,
    notes: list[str],
) -> RunResult:
    """The RunResult of one level's outcomes (samples in ms)."""
    result = RunResult(
        engine=engine,
        workload=workload,
        dtype=dtype,
        concurrency=level.concurrency,
        num_requests=0,
        prompt_tokens=0,
        output_tokens=0,
        duration_s=duration_s,
        request_rate=level.request_rate,
    )
    errors: list[str] = []
    num_short = 0
    for outcome in outcomes:
        if outcome.error is not None or not outcome.arrivals:
            result.num_errors += 1
            errors.append(outcome.error or "the stream ended without a token")
            continue
        ttft_s, gaps_s, e2e_s = token_samples(outcome.start_s, outcome.arrivals)
        num_tokens = len(gaps_s) + 1
        num_short += num_tokens != outcome.request.max_tokens
        result.num_requests += 1
        result.prompt_tokens += len(outcome.request.prompt_token_ids)
        result.output_tokens += num_tokens
        result.ttft_ms.append(1000 * ttft_s)
        result.itl_ms.extend(1000 * g for g in gaps_s)
        result.e2e_ms.append(1000 * e2e_s)
    if num_short:
        notes = [*notes, f"{num_short} requests did not return exactly max_tokens tokens"]
    if errors:
        distinct = list(dict.fromkeys(errors))[:MAX_ERRORS_IN_NOTES]
        notes = [*notes, f"{len(errors)} errors, e.g. " + " | ".join(distinct)]
    result.notes = "; ".join(notes)
    return result


class _Progress:
    """A rich progress bar per level, or nothing."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                refresh_per_second=4,
            )
        self._task = None

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def start_level(self, description: str, total: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(description, total=total)

    def advance(self) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task)


class _LevelRun:
    """One level's requests through one driver."""

    def __init__(
        self,
        driver: Driver,
        workload: Workload,
        level: Level,
        arrival_seed: int,
        timeout_s: float | None,
        progress: _Progress,
    ) -> None:
        self.driver = driver
        self.outcomes = [Outcome(r) for r in workload.requests]
        self.level = level
        self.arrival_seed = arrival_seed
        self.timeout_s = timeout_s
        self.progress = progress

    async def run(self) -> float:
        """Runs every request; returns the duration in seconds."""
        start = time.perf_counter()
        if self.level.request_rate:
            await self._open_loop(start)
        else:
            await self._closed_loop()
        return time.perf_counter() - start

    async def _send(self, outcome: Outcome) -> None:
        request = outcome.request
        try:
            outcome.start_s, outcome.arrivals = await self.driver.stream(
                request.prompt_token_ids, request.max_tokens, self.timeout_s
            )
        except Exception as exc:  # noqa: BLE001 - any failure is one error, the run goes on
            outcome.error = str(exc) or type(exc).__name__
        self.progress.advance()

    async def _closed_loop(self) -> None:
        pending: Iterator[Outcome] = iter(self.outcomes)

        async def worker() -> None:
            for outcome in pending:  # a shared iterator: each worker takes the next request
                await self._send(outcome)

        num_workers = min(self.level.concurrency or len(self.outcomes), len(self.outcomes))
        await asyncio.gather(*(worker() for _ in range(num_workers)))

    async def _open_loop(self, start: float) -> None:
        times = poisson_arrivals(len(self.outcomes), self.level.request_rate, self.arrival_seed)
        slots = asyncio.Semaphore(self.level.concurrency) if self.level.concurrency else None

        async def send(outcome: Outcome) -> None:
            async with slots or contextlib.nullcontext():
                await self._send(outcome)

        tasks = []
        for outcome, at_s in zip(self.outcomes, times):
            delay = start + at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(outcome)))
        await asyncio.gather(*tasks)


def warmup_requests(num_requests: int, id_bound: int, seed: int = 0) -> list[BenchRequest]:
    """Short random requests that are none of the workload's prompts, so that warming up
    does not fill the prefix cache with what is about to be measured."""
    rng = random.Random(seed + 1_000_003)
    return [
        BenchRequest([rng.randrange(1, max(2, id_bound)) for _ in range(32)], 8)
        for _ in range(num_requests)
    ]


async def _warm_up(
    driver: Driver, workload: Workload, num_requests: int, info: ModelInfo, timeout_s: float | None
) -> str | None:
    """Sends `num_requests` unmeasured requests one by one; the first error, if any."""
    # Ids below the vocabulary, or below the workload's own largest id when that is unknown.
    id_bound = info.vocab_size or 1 + max(max(r.prompt_token_ids) for r in workload.requests)
    for request in warmup_requests(num_requests, id_bound):
        try:
            await driver.stream(request.prompt_token_ids, request.max_tokens, timeout_s)
        except Exception as exc:  # noqa: BLE001 - reported in the notes, not fatal
            return f"warm-up failed: {exc}"
    return None


async def arun_sweep(
    target: Target,
    workload: Workload,
    levels: Sequence[Level],
    *,
    arrival_seed: int = 0,
    warmup: int = 2,
    progress: bool = False,
    engine: str | None = None,
    timeout_s: float | None = None,
) -> list[RunResult]:
    """One RunResult per level, in order, over one connection; `warmup` unmeasured requests
    go first. `engine` labels the results (default "pagemesh gRPC" / "pagemesh HTTP");
    `timeout_s` bounds each request (None = no limit); `arrival_seed` seeds open-loop
    arrivals."""
    if not workload.requests:
        raise ValueError("the workload has no requests")
    caps = [lv.concurrency or len(workload.requests) for lv in levels]
    driver = open_driver(target, max(caps, default=1))
    try:
        info = await driver.model_info()
        engine = engine or f"pagemesh {'HTTP' if target.protocol == 'http' else 'gRPC'}"
        notes = [
            f"model {info.name}" if info.name else "",
            target.describe(),
            workload.description,
            await _warm_up(driver, workload, warmup, info, timeout_s),
        ]
        notes = [n for n in notes if n]
        results = []
        with _Progress(progress) as bar:
            for level in levels:
                bar.start_level(
                    f"{engine} {workload.name} {level.describe()}", len(workload.requests)
                )
                run = _LevelRun(driver, workload, level, arrival_seed, timeout_s, bar)
                duration_s = await run.run()
                results.append(
                    summarize(
                        run.outcomes, duration_s, engine, workload.name, info.dtype, level, notes
                    )
                )
        return results
    finally:
        await driver.close()


def run_sweep(
    target: Target, workload: Workload, levels: Sequence[Level], **kwargs
) -> list[RunResult]:
    """Blocking `arun_sweep`: one RunResult per level, in order."""
    return asyncio.run(arun_sweep(target, workload, levels, **kwargs))


def run_workload(
    target: Target, workload: Workload, *, concurrency: int = 0, request_rate: float = 0.0, **kwargs
) -> RunResult:
    """One level of `workload` against `target` (see `arun_sweep` for the other arguments)."""
    return run_sweep(target, workload, [Level(concurrency, request_rate)], **kwargs)[0]


async def afetch_model_info(target: Target) -> ModelInfo:
    driver = open_driver(target)
    try:
        return await driver.model_info()
    finally:
        await driver.close()


def fetch_model_info(target: Target) -> ModelInfo:
    """What the target serves (vocabulary size over gRPC only: OpenAI's API does not say)."""
    return asyncio.run(afetch_model_info(target))
