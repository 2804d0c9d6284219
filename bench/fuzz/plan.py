"""Which probe goes out as request i of a run: its kind (drawn by weight) and its spec (drawn
from that kind's strategy), both from (seed, i) alone, so any request can be sent again by
itself (`--only i`)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import strategies as st

from bench.fuzz import malformed, strategies
from bench.fuzz.drawing import draw
from bench.fuzz.probes import generate_request
from bench.fuzz.specs import ModelFacts, Spec, Storm

# How often each kind is drawn, relative to the others. A storm is 5-30 requests (clients).
KIND_WEIGHTS = {
    "grpc_fields": 30.0,  # every GenerateRequest field, valid and not
    "http_completion": 16.0,  # /v1/completions bodies
    "http_chat": 12.0,  # /v1/chat/completions bodies
    "http_malformed": 10.0,  # bodies that are not JSON objects, wrong content types, methods, paths
    "http_raw_socket": 4.0,  # broken HTTP/1.1 on a socket
    "grpc_malformed": 6.0,  # message bytes no serializer writes, unknown methods
    "grpc_raw_socket": 2.0,  # broken HTTP/2 on the gRPC port
    "slowloris": 4.0,  # a few bytes at a time, or silence with the connection held
    "oversized": 0.3,  # past the gRPC message limit, as large over HTTP
    "disconnect_storm": 0.4,  # many clients at once, each leaving mid-stream
}
KINDS = tuple(KIND_WEIGHTS)


@dataclass(frozen=True)
class Probe:
    kind: str
    index: int
    spec: Spec

    @property
    def num_requests(self) -> int:
        return len(self.spec.clients) if isinstance(self.spec, Storm) else 1


class Plan:
    def __init__(
        self,
        facts: ModelFacts,
        grpc_limit_bytes: int,
        seed: int,
        weights: dict[str, float] | None = None,
    ) -> None:
        self.seed = seed
        self.weights = {k: w for k, w in (weights or KIND_WEIGHTS).items() if w > 0}
        valid_bytes = strategies.grpc_fields(facts, False).map(
            lambda f: generate_request(f).SerializeToString()
        )
        self.strategies: dict[str, st.SearchStrategy[Spec]] = {
            "grpc_fields": strategies.grpc_generate(facts),
            "http_completion": strategies.http_completion(facts),
            "http_chat": strategies.http_chat(facts),
            "http_malformed": malformed.http_raw(facts),
            "http_raw_socket": malformed.raw_http_requests(facts),
            "grpc_malformed": malformed.grpc_raw(valid_bytes),
            "grpc_raw_socket": malformed.raw_grpc_bytes(),
            "slowloris": malformed.slowloris(facts),
            "oversized": malformed.oversized(grpc_limit_bytes),
            "disconnect_storm": malformed.storm(facts),
        }
        unknown = set(self.weights) - set(self.strategies)
        if unknown:
            raise ValueError(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")

    def kind(self, index: int) -> str:
        """The first requests take each kind once; the rest are drawn by weight."""
        kinds = list(self.weights)
        if index < len(kinds):
            return kinds[index]
        return random.Random(f"{self.seed}:{index}:kind").choices(
            kinds, [self.weights[k] for k in kinds]
        )[0]

    def probe(self, index: int) -> Probe:
        kind = self.kind(index)
        return Probe(kind, index, draw(self.strategies[kind], self.seed, index))

    def probes(self, num_requests: int) -> Iterator[Probe]:
        """Probes until they make `num_requests` requests (a last storm may pass it)."""
        index = total = 0
        while total < num_requests:
            probe = self.probe(index)
            yield probe
            total += probe.num_requests
            index += 1
