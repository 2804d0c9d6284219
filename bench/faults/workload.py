"""The fault matrix's clients: N clients x M streamed requests, each resuming by request id
when its stream breaks, as a client of pagemesh is meant to (docs/fault-tolerance.md).

Every request asks for its tokens' logprobs (top 2); every fourth samples with a seed and
every filter and penalty on, the rest are greedy; every third is constrained to a JSON schema
(structured output), so that a grammar's state must survive each fault too. Each chunk's
arrival time is kept, so the longest a client waited between two chunks (a resume
included) is known.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from pagemesh.runtime import keepalive
from pagemesh.runtime.tls import TlsConfig
from protos.pagemesh.v1 import generate_pb2, generate_pb2_grpc

SEEDED_EVERY = 4
SEEDED_SAMPLING = dict(
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    min_p=0.02,
    repetition_penalty=1.1,
    presence_penalty=0.3,
    frequency_penalty=0.2,
)
NUM_LOGPROBS = 2
CONSTRAINED_EVERY = 3
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
LOGPROB_TOLERANCE = 1e-4  # recomputed after a resume: fp32 noise, not a different token
# A broken stream: the router died, or froze and keepalive gave up on it.
_RESUMABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
    }
)
# Dial a restarted router again within a second (gRPC's default backoff reaches 120 s).
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    *keepalive.CHANNEL_OPTIONS,
]


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    max_tokens: int
    seed: int | None  # None: greedy
    constrained: bool = False  # the output must be JSON valid against SCHEMA
    images: tuple[bytes, ...] = ()  # one per image token in `prompt` (a vision-language model)
    model: str = ""  # a LoRA adapter's name; "": the base model

    def to_pb(self) -> generate_pb2.GenerateRequest:
        request = generate_pb2.GenerateRequest(
            request_id=self.request_id,
            token_ids=generate_pb2.TokenIds(ids=self.prompt),
            logprobs=NUM_LOGPROBS,
            images=self.images,
            model=self.model,
        )
        request.stopping.max_tokens = self.max_tokens
        if self.constrained:  # ends when the JSON is complete
            request.constraint.json_schema = json.dumps(SCHEMA)
        else:
            request.stopping.ignore_eos = True
        request.sampling.temperature = 0.0
        if self.seed is not None:
            for name, value in SEEDED_SAMPLING.items():
                setattr(request.sampling, name, value)
            request.sampling.seed = self.seed
        return request


@dataclass
class RequestResult:
    spec: RequestSpec
    token_ids: list[int] = field(default_factory=list)
    # Per token: (chosen logprob, ((token id, logprob) of the top alternatives)).
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # time.monotonic() of each chunk
    text: str = ""
    num_resumes: int = 0
    finish_reason: int = 0
    error: str | None = None

    def schema_valid(self) -> bool:
        """A constrained request that ended (not cut at max_tokens) is JSON valid against
        SCHEMA."""
        import jsonschema

        try:
            jsonschema.validate(json.loads(self.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    @property
    def longest_gap_s(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)

    def same_as(self, other: RequestResult) -> bool:
        """Same tokens, and logprobs within LOGPROB_TOLERANCE (same alternatives)."""
        if self.token_ids != other.token_ids or len(self.logprobs) != len(other.logprobs):
            return False
        for (lp, top), (other_lp, other_top) in zip(self.logprobs, other.logprobs):
            if abs(lp - other_lp) > LOGPROB_TOLERANCE or len(top) != len(other_top):
                return False
            if any(
                a != b or abs(x - y) > LOGPROB_TOLERANCE for (a, x), (b, y) in zip(top, other_top)
            ):
                return False
        return True


def plan(
    num_clients: int,
    requests_per_client: int,
    max_tokens: int,
    tag: str,
    seed: int = 0,
    images: tuple[bytes, ...] = (),
    image_token_id: int = 0,
    adapters: tuple[str, ...] = (),
) -> list[list[RequestSpec]]:
    """Each client's requests, in order; prompts of 8-40 random tokens from a fixed seed, so
    two runs with different tags send the same requests. With `images`, each prompt starts
    with `image_token_id` standing for one of them (in turn: requests share images). With
    `adapters`, the requests name each LoRA adapter and the base model in turn."""
    models = (*adapters, "") if adapters else ("",)
    rng = random.Random(seed)
    clients = []
    for c in range(num_clients):
        requests = []
        for r in range(requests_per_client):
            index = c * requests_per_client + r
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))]
            shown = (images[index % len(images)],) if images else ()
            if shown:
                prompt = [image_token_id, *prompt]
            requests.append(
                RequestSpec(
                    f"{tag}-{index}",
                    prompt,
                    max_tokens,
                    1000 + index if index % SEEDED_EVERY == 0 else None,
                    index % CONSTRAINED_EVERY == 1,
                    shown,
                    models[index % len(models)],
                )
            )
        clients.append(requests)
    return clients


@dataclass
class Run:
    results: list[RequestResult]
    disturbed_at: float | None  # time.monotonic() when `disturb` was called
    ended_at: float


class Clients:
    """Runs a plan against the router at `address`; `resume_deadline_s` bounds how long a
    client keeps trying to resume one broken stream."""

    def __init__(
        self, address: str, tls: TlsConfig | None = None, resume_deadline_s: float = 120.0
    ) -> None:
        self.channel = (tls or TlsConfig()).channel(address, options=_CHANNEL_OPTIONS)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.resume_deadline_s = resume_deadline_s

    def close(self) -> None:
        self.channel.close()

    def run(
        self,
        clients: list[list[RequestSpec]],
        disturb: Callable[[], None] | None = None,
        after_tokens: int = 0,
    ) -> Run:
        """Every client at once, each its requests one after another; `disturb()` is called
        once `after_tokens` tokens have arrived in all."""
        received = [0]
        lock = threading.Lock()
        flowing = threading.Event()

        def on_tokens(count: int) -> None:
            with lock:
                received[0] += count
                if received[0] >= after_tokens:
                    flowing.set()

        def client(specs: list[RequestSpec]) -> list[RequestResult]:
            return [self.request(spec, on_tokens) for spec in specs]

        disturbed_at = None
        with ThreadPoolExecutor(len(clients)) as pool:
            futures = [pool.submit(client, specs) for specs in clients]
            if disturb is not None:
                if not flowing.wait(300):
                    raise TimeoutError("the streams never started")
                disturbed_at = time.monotonic()
                disturb()
            results = [r for future in futures for r in future.result()]
        return Run(results, disturbed_at, time.monotonic())

    def request(self, spec: RequestSpec, on_tokens: Callable[[int], None]) -> RequestResult:
        """One request to its end: a broken stream is resumed by request id (from the start
        when no token came yet: a request the router never checkpointed is sent again)."""
        result = RequestResult(spec)
        deadline = None
        while True:
            request = (
                spec.to_pb()
                if not result.token_ids
                else generate_pb2.GenerateRequest(
                    request_id=spec.request_id, resume_from=len(result.token_ids)
                )
            )
            try:
                for chunk in self.stub.Generate(request, timeout=600):
                    result.chunk_times.append(time.monotonic())
                    result.token_ids += chunk.token_ids
                    result.text += chunk.text
                    result.logprobs += [
                        (lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top))
                        for lp in chunk.logprobs
                    ]
                    on_tokens(len(chunk.token_ids))
                    if chunk.finish_reason:
                        result.finish_reason = chunk.finish_reason
                return result
            except grpc.RpcError as exc:
                now = time.monotonic()
                deadline = deadline or now + self.resume_deadline_s
                if exc.code() not in _RESUMABLE or now > deadline:
                    result.error = f"{exc.code().name}: {exc.details()}"
                    return result
                result.num_resumes += 1  # attempts; a router still down fails the next too
                time.sleep(0.2)
