"""The public API through a real mesh: bad input, seeds, cancellation, stop strings,
logprobs, tokenize, model info, health and reflection."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from protos.pagemesh.v1 import generate_pb2
from tests.support.eventually import eventually
from tests.support.mesh_harness import Mesh, greedy_request, scheduler_stats

MAX_MODEL_LEN = 512  # the tiny models' max_position_embeddings


def sampled_request(
    prompt_ids: list[int], seed: int, max_tokens: int = 12
) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=prompt_ids))
    request.sampling.temperature = 1.0
    request.sampling.top_p = 0.95
    request.sampling.top_k = 50
    request.sampling.seed = seed
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = True
    return request


def bad_requests() -> dict[str, generate_pb2.GenerateRequest]:
    cases: dict[str, generate_pb2.GenerateRequest] = {
        "empty text": generate_pb2.GenerateRequest(text=""),
        "no prompt": generate_pb2.GenerateRequest(),
        "empty ids": generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[])),
        "prompt longer than context": greedy_request([5] * (MAX_MODEL_LEN + 3), 1),
        "max_tokens 0": greedy_request([5, 6], 0),
        "max_tokens beyond context": greedy_request([5, 6], MAX_MODEL_LEN),
        "unknown token id": greedy_request([5, 10**6], 4),
    }
    for name, field, value in [
        ("negative temperature", "temperature", -0.5),
        ("top_p 0", "top_p", 0.0),
        ("top_p above 1", "top_p", 1.5),
        ("negative top_k", "top_k", -1),
    ]:
        request = greedy_request([5, 6], 4)
        setattr(request.sampling, field, value)
        cases[name] = request
    return cases


@pytest.mark.parametrize("case", list(bad_requests()))
def test_bad_input_is_invalid_argument_and_the_mesh_keeps_serving(
    tiny_llama_mesh: Mesh, case: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        tiny_llama_mesh.generate(bad_requests()[case])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert len(info.value.details()) > 10  # says what to fix
    good = tiny_llama_mesh.generate(greedy_request([5, 6, 7], 3))
    assert len(good.token_ids) == 3


def test_an_unknown_model_is_not_found_naming_what_is_served(tiny_llama_mesh: Mesh) -> None:
    with pytest.raises(grpc.RpcError) as info:
        tiny_llama_mesh.generate(greedy_request([5, 6], 4, model="no-such-model"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'no-such-model' is not served here" in info.value.details()
    assert "the LoRA adapters are none" in info.value.details()


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny_llama_mesh: Mesh) -> None:
    prompt = [11, 12, 13, 14]
    first = tiny_llama_mesh.generate(sampled_request(prompt, seed=1234)).token_ids
    again = tiny_llama_mesh.generate(sampled_request(prompt, seed=1234)).token_ids
    assert first == again
    others = [sampled_request([20 + i] * (3 + i), seed=i) for i in range(7)]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(tiny_llama_mesh.generate, [sampled_request(prompt, seed=1234), *others])
        )
    assert results[0].token_ids == first
    different = [
        tiny_llama_mesh.generate(sampled_request(prompt, seed=s)).token_ids for s in (1, 2, 3)
    ]
    assert any(tokens != first for tokens in different), "the seed has no effect"


def test_cancelling_a_stream_returns_every_block(tiny_llama_mesh: Mesh, redis_url: str) -> None:
    request = greedy_request(list(range(1, 100)), 400)
    call = tiny_llama_mesh.stub.Generate(request)
    received = 0
    for chunk in call:
        received += len(chunk.token_ids)
        if received >= 5:
            break
    stats = scheduler_stats(redis_url, "e2e-llama")
    assert stats.num_running == 1 and stats.num_free_blocks < stats.num_blocks
    call.cancel()

    def freed() -> bool:
        stats = scheduler_stats(redis_url, "e2e-llama")
        return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0

    eventually(
        freed,
        10,
        lambda: f"blocks still held: {scheduler_stats(redis_url, 'e2e-llama')}",
        interval_s=0.05,
    )
    assert len(tiny_llama_mesh.generate(greedy_request([3, 4], 2)).token_ids) == 2


def test_stop_string_ends_the_request_before_the_match(tiny_llama_mesh: Mesh) -> None:
    full = tiny_llama_mesh.generate(greedy_request([40, 41, 42], 24))
    assert len(full.text) > 6, full.text
    stop = full.text[3:6]
    request = greedy_request([40, 41, 42], 24)
    request.stopping.stop.append(stop)
    stopped = tiny_llama_mesh.generate(request)
    assert stopped.finish_reason == generate_pb2.FINISH_REASON_STOP
    assert stopped.text == full.text[: full.text.index(stop)]


def test_logprobs_tokenize_and_model_info(tiny_llama_mesh: Mesh) -> None:
    request = greedy_request([7, 8, 9], 4, logprobs=3)
    result = tiny_llama_mesh.generate(request)
    assert [lp.token_id for lp in result.logprobs] == result.token_ids
    for lp in result.logprobs:
        assert len(lp.top) == 3 and lp.top[0].token_id == lp.token_id  # greedy takes the best
        assert lp.logprob <= 0 and lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob

    tokenized = tiny_llama_mesh.stub.Tokenize(generate_pb2.TokenizeRequest(text="hello world"))
    assert len(tokenized.token_ids) == len(tokenized.tokens) > 0
    text = tiny_llama_mesh.generate(
        generate_pb2.GenerateRequest(
            text="hello world", stopping=generate_pb2.StoppingCriteria(max_tokens=3)
        )
    )
    assert text.prompt_tokens == len(tokenized.token_ids)

    info = tiny_llama_mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.model == "tiny-llama" and info.max_model_len == MAX_MODEL_LEN
    assert info.dtype == "float32" and info.layout.tensor_parallel_size == 1
    assert info.num_kv_blocks == 64 and info.kv_cache_sizing == "--num-kv-blocks 64, as given"
    assert info.kv_cache_bytes > 0 and info.kv_cache_bytes % 64 == 0
    named = tiny_llama_mesh.generate(greedy_request([5, 6], 2, model="tiny-llama"))
    assert len(named.token_ids) == 2


def test_health_and_reflection(tiny_llama_mesh: Mesh) -> None:
    health = health_pb2_grpc.HealthStub(tiny_llama_mesh.channel)
    for service in ("", "pagemesh.v1.Generation"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    database = ProtoReflectionDescriptorDatabase(tiny_llama_mesh.channel)
    assert "pagemesh.v1.Generation" in database.get_services()
    service = database.FindFileContainingSymbol("pagemesh.v1.Generation")
    assert service.package == "pagemesh.v1"
