"""Chaos helpers: many concurrent streams, a process killed while they run, and the check
that every stream still equals its undisturbed output, with no gap and no repeat.

Every fourth stream samples with a seed and every filter and penalty on, the rest are
greedy: a resumed seeded stream must give exactly its undisturbed tokens (the sampler's
draws are a function of seed and position, and its penalties of the tokens so far)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request
from tests.support.eventually import eventually


SEEDED_EVERY = 4
SEEDED_SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                       repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2)


@dataclass
class Stream:
    request_id: str
    prompt: list[int]
    seed: int | None = None  # None: greedy
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    error: str | None = None

    def request(self, max_tokens: int) -> generate_pb2.GenerateRequest:
        request = greedy_request(self.prompt, max_tokens, request_id=self.request_id)
        if self.seed is not None:
            for name, value in SEEDED_SAMPLING.items():
                setattr(request.sampling, name, value)
            request.sampling.seed = self.seed
        return request


def make_streams(prompt_list: list[list[int]], tag: str) -> list[Stream]:
    """One stream a prompt; the `SEEDED_EVERY`-th ones seeded (by position, so the streams
    of two runs pair up)."""
    return [Stream(f"{tag}-{i}", p, seed=1000 + i if i % SEEDED_EVERY == 0 else None)
            for i, p in enumerate(prompt_list)]


def prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))] for _ in range(num)]


def run_streams(mesh: Mesh, prompt_list: list[list[int]], max_tokens: int, tag: str,
                disturb: Callable[[], None] | None = None, after_tokens: int = 0) -> list[Stream]:
    """All prompts at once, one stream each; `disturb()` runs once `after_tokens` tokens
    have arrived in all (so the disturbance hits streams mid-flight)."""
    streams = make_streams(prompt_list, tag)
    received = [0]
    lock = threading.Lock()
    started = threading.Event()

    def one(stream: Stream) -> None:
        try:
            for chunk in mesh.stub.Generate(stream.request(max_tokens), timeout=300):
                stream.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason:
                    stream.finish_reason = chunk.finish_reason
                with lock:
                    received[0] += len(chunk.token_ids)
                    if received[0] >= after_tokens:
                        started.set()
        except grpc.RpcError as exc:
            stream.error = f"{exc.code()}: {exc.details()}"
            started.set()

    with ThreadPoolExecutor(len(streams)) as pool:
        futures = [pool.submit(one, s) for s in streams]
        if disturb is not None:
            assert started.wait(120), "the streams never started"
            disturb()
        for future in futures:
            future.result()
    return streams


def assert_same_streams(disturbed: list[Stream], undisturbed: list[Stream], max_tokens: int,
                        model: torch.nn.Module) -> None:
    """Every stream complete and error-free; equal to its undisturbed run token for token,
    or — for a greedy one, where the two part at a near-tie — both equal to transformers up
    to that tie. A seeded stream must be exactly equal."""
    errors = [(s.request_id, s.error) for s in disturbed if s.error]
    assert not errors, errors
    for ours, calm in zip(disturbed, undisturbed):
        assert len(ours.token_ids) == max_tokens, (ours.request_id, len(ours.token_ids))
        assert ours.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert ours.seed == calm.seed
        if ours.seed is not None:
            assert ours.token_ids == calm.token_ids, f"seeded stream {ours.request_id} changed"
        elif ours.token_ids != calm.token_ids:
            reference = hf_greedy(model, ours.prompt, max_tokens)
            assert_greedy_match(model, ours.prompt, ours.token_ids, reference)
            assert_greedy_match(model, calm.prompt, calm.token_ids, reference)


def entries(redis_url: str, cluster: str, kind: str) -> dict[str, dict]:
    client = redis.Redis.from_url(redis_url)
    try:
        found = {}
        for key in client.scan_iter(f"{cluster}:{kind}:*"):
            raw = client.get(key)
            if raw is not None:
                found[key.decode().rsplit(":", 1)[1]] = json.loads(raw)
        return found
    finally:
        client.close()


def health_status(mesh: Mesh) -> int:
    try:
        return health_pb2_grpc.HealthStub(mesh.channel).Check(
            health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return health_pb2.HealthCheckResponse.UNKNOWN


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds it took for `predicate` to hold; fails after `timeout_s`."""
    start = time.monotonic()
    eventually(predicate, timeout_s, what)
    return time.monotonic() - start
