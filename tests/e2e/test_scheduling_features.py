"""Scheduling features through the full mesh, each checked against `transformers`:
prefix caching on and off, chunked prefill on and off, a KV cache so small that
preemption (recompute and swap) must happen, and n > 1 samples."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request, scheduler_stats

LAYOUTS = {
    # name: flags of `pagemesh up`
    "prefix-cache+chunked": [
        "--max-num-batched-tokens",
        "48",
        "--long-prefill-token-threshold",
        "24",
    ],
    "no-prefix-cache+no-chunking": [
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "512",
    ],
    "tiny-cache-recompute": ["--num-kv-blocks", "24", "--preemption-mode", "recompute"],
    "tiny-cache-swap": ["--num-kv-blocks", "24", "--preemption-mode", "swap"],
    # Priorities 0-2 (the concurrent requests'): admission order and preemption victims by
    # priority, under the same cache pressure.
    "tiny-cache-priority": ["--num-kv-blocks", "24", "--scheduling-policy", "priority"],
}
SHARED_PREFIX_LEN = 40
# What the background of the constrained test adds to each request: long enough that the
# tiny cache's queue stays backed up between polls on a fast CPU (48 did not on a Xeon).
LOAD_EXTRA_TOKENS = 96
NUM_REQUESTS = 12


def workload(vocab_size: int) -> list[tuple[list[int], int]]:
    """Prompts sharing a 40-token prefix (some whole-block, some not) plus unrelated ones."""
    rng = random.Random(5)
    prefix = [rng.randrange(1, vocab_size) for _ in range(SHARED_PREFIX_LEN)]
    requests = []
    for i in range(NUM_REQUESTS):
        tail = [rng.randrange(1, vocab_size) for _ in range(3 + 7 * i % 29)]
        prompt = prefix + tail if i % 3 else tail * 2
        requests.append((prompt, 12 + (5 * i) % 20))
    return requests


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout_mesh(
    request: pytest.FixtureRequest,
    tiny_llama_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str, Mesh]]:
    name = request.param
    cluster = f"e2e-sched-{name}"
    mesh = Mesh(
        str(tiny_llama_dir),
        tmp_path_factory.mktemp("logs") / f"{name}.log",
        redis_url=redis_url,
        cluster=cluster,
        extra_args=LAYOUTS[name],
    )
    try:
        yield name, cluster, mesh.wait_ready()
    finally:
        mesh.stop()


def test_greedy_equals_transformers_under_each_layout(
    layout_mesh: tuple[str, str, Mesh], hf_model: torch.nn.Module, redis_url: str
) -> None:
    name, cluster, mesh = layout_mesh
    requests = workload(hf_model.config.vocab_size)
    references = [hf_greedy(hf_model, prompt, n) for prompt, n in requests]
    solo = [mesh.generate(greedy_request(prompt, n)).token_ids for prompt, n in requests]
    for (prompt, _), ours, reference in zip(requests, solo, references):
        assert_greedy_match(hf_model, prompt, ours, reference)
    # Together, the tiny cache's requests ask LOAD_EXTRA_TOKENS more each, so they are still
    # growing when the 24 blocks run out (on a fast CPU the short ones finished first).
    if name.startswith("tiny-cache"):
        requests = [(prompt, n + LOAD_EXTRA_TOKENS) for prompt, n in requests]
        references = [hf_greedy(hf_model, prompt, n) for prompt, n in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(
            pool.map(
                lambda i: mesh.generate(greedy_request(*requests[i], priority=i % 3)).token_ids,
                range(len(requests)),
            )
        )
    for (prompt, _), ours, reference in zip(requests, together, references):
        assert_greedy_match(hf_model, prompt, ours, reference)

    stats = scheduler_stats(redis_url, cluster)
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
    if name.startswith("prefix-cache"):
        assert stats.prefix_cache_hit_rate > 0.2, stats
    if name.startswith("no-prefix-cache"):
        assert stats.prefix_cache_hit_rate == 0
    if name.startswith("tiny-cache"):
        assert stats.num_preemptions > 0, "the cache was meant to run out"
    if name == "tiny-cache-swap":  # swapped, every time, and every swapped request came back
        assert stats.num_swap_outs == stats.num_preemptions == stats.num_swap_ins, stats
    if name == "tiny-cache-recompute":
        assert stats.num_swap_outs == stats.num_swap_ins == 0, stats


def n_request(
    prompt: list[int], n: int, temperature: float, seed: int | None
) -> generate_pb2.GenerateRequest:
    request = greedy_request(prompt, 10, n=n)
    request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    return request


def samples_of(
    mesh: Mesh, request: generate_pb2.GenerateRequest
) -> tuple[list[list[int]], generate_pb2.GenerateResponse]:
    samples: dict[int, list[int]] = {}
    last = None
    for chunk in mesh.stub.Generate(request, timeout=120):
        samples.setdefault(chunk.index, []).extend(chunk.token_ids)
        last = chunk
    return [samples[i] for i in sorted(samples)], last


def test_n_samples_share_the_prompt_and_are_reproducible(
    tiny_llama_mesh: Mesh, hf_model: torch.nn.Module
) -> None:
    prompt = list(range(3, 40))  # 37 tokens: two full blocks and a partial one
    greedy, last = samples_of(tiny_llama_mesh, n_request(prompt, 4, 0.0, None))
    assert len(greedy) == 4 and all(s == greedy[0] for s in greedy)
    assert greedy[0] == hf_greedy(hf_model, prompt, 10)
    assert last.usage.completion_tokens == 40 and last.usage.prompt_tokens == len(prompt)

    sampled, _ = samples_of(tiny_llama_mesh, n_request(prompt, 4, 1.0, seed=99))
    assert len({tuple(s) for s in sampled}) == 4, "n samples should differ"
    again, _ = samples_of(tiny_llama_mesh, n_request(prompt, 4, 1.0, seed=99))
    assert again == sampled


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def constrained_request(
    prompt: list[int], seed: int | None, n: int = 1
) -> generate_pb2.GenerateRequest:
    request = greedy_request(prompt, 64, n=n)
    request.stopping.ignore_eos = False  # the grammar ends it
    request.constraint.json_schema = json.dumps(SCHEMA)
    if seed is not None:
        request.sampling.temperature = 0.9
        request.sampling.seed = seed
    return request


def test_constrained_requests_are_exact_under_each_layout(
    layout_mesh: tuple[str, str, Mesh],
    hf_model: torch.nn.Module,
    redis_url: str,
    tiny_llama_dir: Path,
) -> None:
    """JSON-schema requests (greedy, seeded, and seeded with n=2) give the same tokens alone
    and among the workload that fills the cache: chunked, prefix-cached, preempted by
    recompute or swapped out and back, their grammar state follows; every output validates."""
    name, cluster, mesh = layout_mesh
    vocab_size = hf_model.config.vocab_size
    requests = [
        constrained_request(prompt, seed, n)
        for (prompt, _), (seed, n) in zip(
            workload(vocab_size)[:4], [(None, 1), (3, 1), (4, 2), (None, 1)]
        )
    ]
    alone = [samples_of(mesh, request)[0] for request in requests]
    preemptions = scheduler_stats(redis_url, cluster).num_preemptions
    # Long enough that the load backs up whatever the order the requests arrive in (on a
    # loaded machine the first could finish before the last is sent); on a tiny cache the
    # constrained requests are sent once it has, so they run while the cache runs out.
    load = [greedy_request(prompt, n + LOAD_EXTRA_TOKENS) for prompt, n in workload(vocab_size)]
    with ThreadPoolExecutor(len(load) + len(requests)) as pool:
        background = [pool.submit(mesh.generate, r) for r in load]
        if name.startswith("tiny-cache"):
            eventually(
                lambda: scheduler_stats(redis_url, cluster).num_waiting > 0,
                120,
                "the load to back up behind the tiny cache",
                interval_s=0.01,
            )
        together = list(pool.map(lambda r: samples_of(mesh, r)[0], requests))
        for future in background:
            future.result()
    assert together == alone, name
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    for samples in alone:
        for tokens in samples:
            assert tokens[-1] == hf_model.config.eos_token_id, tokens  # the JSON ended
            jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)
    if name.startswith("tiny-cache"):  # the cache ran out while they ran
        assert scheduler_stats(redis_url, cluster).num_preemptions > preemptions
