"""KV that moves between engine groups, through real meshes: disaggregated prefill/decode
(`pagemesh up --prefill-replicas 1 --decode-replicas 2`) gives what a colocated group gives
(greedy against transformers too, seeded n > 1, structured output), and a drained decode
group hands its running request, with its KV, to the other one — nothing recomputed, the
stream unchanged. The registry's counters say which path ran."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh.tools.admin import AdminClient
from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import assert_greedy_match, hf_greedy
from tests.support.mesh_harness import Mesh, entries, greedy_request, scheduler_stats_at

CLUSTER = "e2e-kv-moves"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pd_mesh(
    tiny_llama_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Mesh]:
    log = tmp_path_factory.mktemp("logs") / "pd-mesh.log"
    mesh = Mesh(
        str(tiny_llama_dir),
        log,
        redis_url=redis_url,
        cluster=CLUSTER,
        extra_args=["--prefill-replicas", "1", "--decode-replicas", "2", "--num-kv-blocks", "64"],
    )
    try:
        yield mesh.wait_ready()
    finally:
        mesh.stop()


def samples_of(mesh: Mesh, request: generate_pb2.GenerateRequest) -> list[list[int]]:
    samples: dict[int, list[int]] = {}
    for chunk in mesh.stub.Generate(request, timeout=120):
        samples.setdefault(chunk.index, []).extend(chunk.token_ids)
    return [samples[i] for i in sorted(samples)]


def schedulers(redis_url: str, wait_s: float = 0.0) -> dict[str, dict]:
    time.sleep(wait_s)  # a heartbeat publishes the counters
    return entries(redis_url, CLUSTER, "scheduler")


def total(found: dict[str, dict], field: str, role: str) -> int:
    return sum(e.get(field, 0) for e in found.values() if e.get("role") == role)


def test_prefill_then_decode_equals_colocated_and_transformers(
    pd_mesh: Mesh, tiny_llama_mesh: Mesh, tiny_llama_dir: Path, redis_url: str
) -> None:
    before = schedulers(redis_url)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [list(range(3, 3 + n)) for n in (1, 15, 16, 17, 70)]
    for prompt in prompts:
        request = greedy_request(prompt, 12, logprobs=2)
        ours, colocated = pd_mesh.generate(request), tiny_llama_mesh.generate(request)
        assert ours.token_ids == colocated.token_ids
        for a, b in zip(ours.logprobs, colocated.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert_greedy_match(model, prompt, ours.token_ids, hf_greedy(model, prompt, 12))
    seeded = greedy_request(list(range(5, 45)), 16, n=3)
    seeded.sampling.temperature, seeded.sampling.seed = 0.9, 1234
    assert samples_of(pd_mesh, seeded) == samples_of(tiny_llama_mesh, seeded)
    structured = greedy_request(list(range(7, 30)), 40)
    structured.stopping.ignore_eos = False
    structured.constraint.json_schema = json.dumps(SCHEMA)
    text = pd_mesh.generate(structured).text
    assert text == tiny_llama_mesh.generate(structured).text and set(json.loads(text)) == {"n"}

    after = schedulers(redis_url, wait_s=2.5)

    def delta(field: str, role: str) -> int:
        return total(after, field, role) - total(before, field, role)

    # One hold per sample that did not end at its first token (greedy: none does here).
    num_samples = len(prompts) + 3 + 1
    assert delta("kv_holds", "prefill") == delta("kv_holds_pulled", "prefill") == num_samples
    assert delta("kv_imports_pulled", "decode") == num_samples
    assert delta("kv_imports_failed", "decode") == 0
    assert total(after, "num_recomputed_tokens", "decode") == 0
    # The same, as Prometheus counters on the decode groups' metrics endpoints.
    for entry in (e for e in after.values() if e.get("role") == "decode"):
        text = httpx.get(f"http://{entry['metrics_address']}/metrics", timeout=10).text
        assert 'pagemesh:kv_recomputed_tokens_total{group="' in text
        assert _sample(text, "pagemesh:kv_recomputed_tokens_total") == 0
    assert (
        sum(
            _sample(
                httpx.get(f"http://{e['metrics_address']}/metrics", timeout=10).text,
                "pagemesh:kv_transferred_blocks_total",
            )
            for e in after.values()
            if e.get("role") == "decode"
        )
        > 0
    )


def _sample(text: str, name: str) -> float:
    """The value of the one sample of `name` in an exposition."""
    (line,) = [line for line in text.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_a_drained_decode_group_hands_its_request_over_with_its_kv(
    pd_mesh: Mesh, redis_url: str
) -> None:
    request = greedy_request(list(range(9, 70)), 300)
    request.stopping.ignore_eos = True
    undisturbed = pd_mesh.generate(request)
    before = schedulers(redis_url, wait_s=2.5)
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("g", pd_mesh.generate(request)))
    thread.start()
    busy = None
    deadline = time.monotonic() + 30
    decode = {k: e["address"] for k, e in before.items() if e.get("role") == "decode"}
    while busy is None and time.monotonic() < deadline:
        busy = next(
            (k for k, address in decode.items() if scheduler_stats_at(address).num_running), None
        )
    assert busy is not None, "the request never ran on a decode group"
    reply = AdminClient(pd_mesh.channel).drain(busy)
    thread.join(timeout=120)
    try:
        assert result["g"].token_ids == undisturbed.token_ids  # type: ignore[attr-defined]
        assert reply.num_migrated == 1, reply
        after = schedulers(redis_url, wait_s=2.5)
        assert after[busy]["kv_holds_pulled"] == before[busy].get("kv_holds_pulled", 0) + 1
        assert total(after, "num_recomputed_tokens", "decode") == 0
    finally:
        AdminClient(pd_mesh.channel).drain(busy, undo=True)


def test_drain_names_a_group(pd_mesh: Mesh) -> None:
    import grpc

    with pytest.raises(grpc.RpcError) as caught:
        AdminClient(pd_mesh.channel).drain("")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
