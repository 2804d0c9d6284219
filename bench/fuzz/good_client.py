"""The clients that must be served throughout: greedy requests whose answers are known
(measured on the idle mesh first), sent back to back over gRPC and over HTTP while the fuzz
runs; and, on the quiet mesh afterwards, the disconnect audit: does a client that leaves
mid-stream free its request at once, on each path?"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import grpc

from bench.fuzz import mesh as mesh_checks
from bench.fuzz import outcomes as oc
from bench.fuzz.probes import Targets, send
from bench.fuzz.specs import Cancel, GrpcGenerate, HttpJson, ModelFacts
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

GOOD_MAX_TOKENS = 8
NUM_CASES = 3
MIN_TOP2_MARGIN = 0.05  # nats between the top two logprobs at every step: no near-tie to flip
MAX_FAILURES_KEPT = 10
BACKOFF_S = 0.25  # after a failure, so that a mesh that is down is not asked in a tight loop


@dataclass(frozen=True)
class GoodCase:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str


@dataclass
class GoodStats:
    transport: str  # "gRPC" or "HTTP"
    num_requests: int = 0
    num_failures: int = 0
    failures: list[str] = field(default_factory=list)  # the first few, with what went wrong
    latencies_s: list[float] = field(default_factory=list)

    def failed(self, message: str) -> None:
        """Counts a failure (the client backs off before its next request)."""
        self.num_failures += 1
        if len(self.failures) < MAX_FAILURES_KEPT:
            self.failures.append(oc.short(message))


def greedy(
    prompt_ids: list[int], max_tokens: int, **kwargs: object
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt_ids), **kwargs
    )
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    return request


async def calibrate(channel: grpc.aio.Channel, facts: ModelFacts) -> tuple[list[GoodCase], float]:
    """Prompts whose greedy answer no float noise can change (every step's top-2 logprobs
    apart by MIN_TOP2_MARGIN), with those answers; and the seconds per token of one alone."""
    stub = generate_pb2_grpc.GenerationStub(channel)
    rng = random.Random(21)
    cases: list[GoodCase] = []
    seconds_per_token = 0.0
    for _ in range(40):
        prompt_ids = [rng.randrange(1, facts.vocab_size) for _ in range(6)]
        start = time.perf_counter()
        chunks = [
            c
            async for c in stub.Generate(
                greedy(prompt_ids, GOOD_MAX_TOKENS, logprobs=2), timeout=60
            )
        ]
        seconds_per_token = (time.perf_counter() - start) / GOOD_MAX_TOKENS
        logprobs = [lp for c in chunks for lp in c.logprobs]
        if min(lp.top[0].logprob - lp.top[1].logprob for lp in logprobs) >= MIN_TOP2_MARGIN:
            cases.append(
                GoodCase(
                    prompt_ids,
                    [t for c in chunks for t in c.token_ids],
                    "".join(c.text for c in chunks),
                )
            )
        if len(cases) == NUM_CASES:
            return cases, seconds_per_token
    raise RuntimeError(f"fewer than {NUM_CASES} of 40 prompts are free of near-ties")


async def good_client(
    transport: str,
    targets: Targets,
    facts: ModelFacts,
    cases: list[GoodCase],
    stop: asyncio.Event,
    deadline_s: float,
) -> GoodStats:
    """Back-to-back requests until `stop`; each must give its known answer within `deadline_s`."""
    stats = GoodStats(transport)
    stub = generate_pb2_grpc.GenerationStub(targets.channels[0])
    while not stop.is_set():
        case = cases[stats.num_requests % len(cases)]
        stats.num_requests += 1
        num_failures = stats.num_failures
        start = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                if transport == "gRPC":
                    chunks = [
                        c async for c in stub.Generate(greedy(case.prompt_ids, GOOD_MAX_TOKENS))
                    ]
                    got = [t for c in chunks for t in c.token_ids]
                    if got != case.token_ids:
                        stats.failed(f"tokens {got}, expected {case.token_ids}")
                else:
                    text = await _http_text(targets, facts, case)
                    if text != case.text:
                        stats.failed(f"text {text!r}, expected {case.text!r}")
        except TimeoutError:
            stats.failed(f"no answer within {deadline_s:g} s")
        except (grpc.aio.AioRpcError, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
            stats.failed(f"{exc!r}")
        stats.latencies_s.append(time.perf_counter() - start)
        if stats.num_failures > num_failures:
            await asyncio.sleep(BACKOFF_S)
    return stats


async def _http_text(targets: Targets, facts: ModelFacts, case: GoodCase) -> str:
    body = {
        "model": facts.name,
        "prompt": case.prompt_ids,
        "max_tokens": GOOD_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with targets.session.post(targets.http_url + "/v1/completions", json=body) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {answer}")
        return answer["choices"][0]["text"]


# ------------------------------------------------------------------ disconnect audit


@dataclass(frozen=True)
class AuditRow:
    what: str
    left: bool  # the client left mid-stream as planned (else the row measured nothing)
    result: str  # how the probe ended (its class and detail)
    freed_after_s: float | None  # None: still held at the limit
    limit_s: float

    @property
    def passed(self) -> bool:
        return self.left and self.freed_after_s is not None


async def disconnect_audit(
    targets: Targets, endpoints: mesh_checks.Endpoints, facts: ModelFacts, seconds_per_token: float
) -> list[AuditRow]:
    """On the quiet mesh, one long greedy request per way of leaving; its blocks must be
    free well before it could have finished on its own."""
    num_tokens = facts.max_model_len - 32
    limit_s = max(1.0, min(5.0, seconds_per_token * num_tokens / 4))
    ids = [7, 8, 9]
    body = {
        "model": facts.name,
        "prompt": ids,
        "max_tokens": num_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    leaving = [
        (
            "gRPC stream cancelled after its first chunk",
            GrpcGenerate(
                {
                    "prompt": ("ids", ids),
                    "sampling": {"temperature": 0.0},
                    "stopping": {"max_tokens": num_tokens, "ignore_eos": True},
                },
                Cancel(1),
            ),
        ),
        (
            "HTTP stream closed after its first event",
            HttpJson("/v1/completions", body | {"stream": True}, {}, Cancel(1)),
        ),
        (
            "HTTP request (not streamed) closed after 0.5 s",
            HttpJson("/v1/completions", body, {}, Cancel(None, 0.5)),
        ),
    ]
    rows = []
    for what, spec in leaving:
        result, detail = (await send(spec, targets))[0]
        left_at = time.monotonic()
        freed = await _wait_quiet(endpoints, limit_s)
        rows.append(
            AuditRow(
                what,
                result == oc.CANCELLED,
                f"{result}: {detail}",
                None if freed is None else freed - left_at,
                limit_s,
            )
        )
        if freed is None:  # let it end on its own before the next one is measured
            await _wait_quiet(endpoints, seconds_per_token * num_tokens * 4 + 30)
    return rows


async def _wait_quiet(endpoints: mesh_checks.Endpoints, timeout_s: float) -> float | None:
    """The monotonic time every group was quiet, or None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await asyncio.to_thread(mesh_checks.group_stats, endpoints)
        if all(s.quiet for s in stats):
            return time.monotonic()
        await asyncio.sleep(0.05)
    return None
