"""A mixture-of-experts model through the whole mesh, under expert parallelism: `pagemesh up
--tp 2 --enable-expert-parallel` on a Qwen2-MoE with 7 experts (placed 4 + 3), a gated
shared expert and a dense layer. Concurrent greedy streams equal transformers, a seed gives
the same samples again, alone and with n = 3, JSON-schema output parses, and the expert load the
ranks count adds up the same in the Admin step stats, the workers' Prometheus counters and
`pagemesh top`. (Kill -9 of an expert-parallel rank is in the fault matrix: `moe-ep`.)"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from pagemesh.tools.admin import AdminClient
from pagemesh.tools.testing.tiny_models import write_tiny_model
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, greedy_request

CLUSTER = "e2e-moe-ep"
NUM_EXPERTS, TOP_K, NUM_LAYERS = 7, 2, 3
SPARSE_LAYERS = (0, 2)  # layer 1 is dense (mlp_only_layers)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("moe") / "tiny-qwen2-moe",
        "qwen2_moe",
        seed=4,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
    )


@pytest.fixture(scope="module")
def mesh(
    moe_model: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    mesh = Mesh(
        str(moe_model),
        tmp_path_factory.mktemp("logs") / "moe.log",
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--tp", "2", "--enable-expert-parallel", "--num-kv-blocks", "96"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in (1, 9, 24, 40)]


def test_expert_parallel_streams_equal_transformers(mesh: Mesh, moe_model: Path) -> None:
    hf_model = AutoModelForCausalLM.from_pretrained(moe_model, dtype=torch.float32).eval()
    with ThreadPoolExecutor(4) as pool:
        results = list(
            pool.map(lambda p: mesh.generate(greedy_request(p, 12)).token_ids, prompts())
        )
    for prompt, ours in zip(prompts(), results, strict=True):
        assert_greedy_match(hf_model, prompt, ours, hf_greedy(hf_model, prompt, 12))


def test_a_seed_repeats_its_samples_alone_and_with_n_3(mesh: Mesh) -> None:
    request = greedy_request(prompts()[2], 10)
    request.sampling.temperature, request.sampling.seed = 0.8, 17
    alone = mesh.generate(request).token_ids
    again = mesh.generate(request).token_ids
    assert alone == again
    request.n = 3

    def samples() -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {}
        finished = set()
        for chunk in mesh.stub.Generate(request, timeout=120):
            tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            if chunk.finish_reason:
                finished.add(chunk.index)
        assert finished == {0, 1, 2} and all(len(t) == 10 for t in tokens.values())
        return tokens

    assert samples() == samples()  # seeded: the three samples repeat


def test_json_schema_output_parses(mesh: Mesh) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    request = greedy_request(prompts()[1], 40)
    request.stopping.ignore_eos = False
    request.constraint.json_schema = json.dumps(schema)
    assert set(json.loads(mesh.generate(request).text)) == {"n"}


def test_expert_load_adds_up_in_admin_metrics_and_top(mesh: Mesh, redis_url: str) -> None:
    admin = AdminClient(mesh.channel)

    def admin_load() -> dict[int, int]:
        [group] = admin.step_stats().groups
        totals: dict[int, int] = {}
        for rank in group.ranks:  # each EP rank counts its share of the tokens
            for load in rank.expert_load:
                assert len(load.tokens) == NUM_EXPERTS
                totals[load.layer] = totals.get(load.layer, 0) + sum(load.tokens)
        return totals

    before = admin_load()
    prompt = [random.Random(9).randrange(1, 500) for _ in range(37)]  # unseen: no cached prefix
    mesh.generate(greedy_request(prompt, 8))
    after = admin_load()
    assert set(after) == set(SPARSE_LAYERS)
    # Each token the model ran (the prompt, then the 7 tokens after the first) picks TOP_K.
    for layer in SPARSE_LAYERS:
        assert after[layer] - before[layer] == TOP_K * (len(prompt) + 7)
    counted = {layer: 0.0 for layer in SPARSE_LAYERS}
    for address in worker_metrics_addresses(redis_url):
        text = httpx.get(f"http://{address}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "pagemesh:worker_moe_expert_tokens_total":
                    counted[int(sample.labels["layer"])] += sample.value
    assert counted == {layer: float(after[layer]) for layer in SPARSE_LAYERS}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagemesh.tools.cli",
            "top",
            "--once",
            "--format",
            "json",
            "--redis-url",
            redis_url,
            "--cluster",
            CLUSTER,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    hot = json.loads(out)["rates"]["hot_experts"]
    [(group, experts)] = hot.items()
    assert experts and experts[0]["layer"] in SPARSE_LAYERS
    assert experts[0]["share"] >= 1 / NUM_EXPERTS and experts[0]["num_experts"] == NUM_EXPERTS


def worker_metrics_addresses(redis_url: str) -> list[str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = list(client.scan_iter(match=f"{CLUSTER}:worker:*"))
        entries = [json.loads(value) for value in client.mget(keys) if value is not None]
    finally:
        client.close()
    return [e["metrics_address"] for e in entries if e.get("metrics_address")]
