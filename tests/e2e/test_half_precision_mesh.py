"""bf16 and fp16 through the whole mesh, against transformers in the same dtype, for every
parallel layout (tp=1, tp=2, pp=2, tp=2 x pp=2), each with the scheduling features on and
happening: a shared prefix hits the prefix cache, long prompts are chunked, and the cache is
small enough that requests are preempted (by swap in bf16, by recompute in fp16).

Every architecture runs in each dtype, on one layout each (Llama, Mistral, Qwen2, Qwen3).
The chosen tokens' logprobs and the top-5 must lie within the bound that
`half_precision_references` derives from transformers' own rounding (twice its distance from
its fp32 run), and greedy tokens may part from transformers' only at a near-tie under twice
its logit noise. The models are realistic (std 0.02, peaked attention) with the parallel
edge shapes: a vocabulary of 509 (odd, so the vocab-parallel head pads), one KV head for
two tensor ranks, three layers over two stages. Worst cases are printed (`pytest -s`)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.pagemesh.v1 import generate_pb2
from tests.support.hf_reference import (
    assert_half_precision_close,
    first_divergence,
    half_precision_references,
)
from tests.support.mesh_harness import greedy_request, scheduler_stats
from tests.support.parallel_layouts import LAYOUTS, run_layout

HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PREEMPTION_MODES = {"bfloat16": "swap", "float16": "recompute"}
# Every architecture in each dtype, one per layout (the runner test covers every pair).
ARCHS = {
    "bfloat16": {"tp1": "llama", "tp2": "mistral", "pp2-uneven": "qwen2", "tp2xpp2": "qwen3"},
    "float16": {"tp1": "qwen3", "tp2": "qwen2", "pp2-uneven": "mistral", "tp2xpp2": "llama"},
}
VOCAB_SIZE = 509
# Blocks of 16 tokens: 9 cannot hold the seven requests at once (about 20 blocks without
# sharing; the longest alone needs 5), so some are preempted, with a margin (12 blocks saw
# none once, in a fast bf16 run); 16-token chunks and a 32-token budget split the prompts.
SCHEDULING_ARGS = [
    "--num-kv-blocks",
    "9",
    "--max-num-batched-tokens",
    "32",
    "--long-prefill-token-threshold",
    "16",
]
SHARED_PREFIX_LEN = 40
MAX_TOKENS = 14
NUM_TOP_LOGPROBS = 5


def workload() -> list[list[int]]:
    """Three prompts behind one 40-token prefix (two whole blocks of it can be shared) and
    four unrelated ones, 1 to 60 tokens long."""
    rng = random.Random(23)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, VOCAB_SIZE) for _ in range(n)]

    prefix = tokens(SHARED_PREFIX_LEN)
    return [prefix + tokens(n) for n in (3, 11, 20)] + [tokens(n) for n in (1, 9, 30, 57)]


@pytest.fixture(scope="module")
def edge_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One realistic edge-shaped model per architecture."""
    return {
        arch: write_realistic_model(
            tmp_path_factory.mktemp(arch) / f"edge-{arch}",
            arch,
            seed=13 + i,
            vocab_size=VOCAB_SIZE,
            num_key_value_heads=1,
            num_hidden_layers=3,
        )
        for i, arch in enumerate(sorted(set(ARCHS["bfloat16"].values())))
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(HALF_DTYPES))
def test_half_precision_layout_matches_transformers(
    dtype: str, layout: str, edge_models: dict[str, Path], redis_url: str, tmp_path: Path
) -> None:
    arch = ARCHS[dtype][layout]
    folder = edge_models[arch]
    hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_half = AutoModelForCausalLM.from_pretrained(folder, dtype=HALF_DTYPES[dtype]).eval()
    prompts = workload()
    references = half_precision_references(hf32, hf_half, prompts, MAX_TOKENS)
    cluster = f"e2e-half-{dtype}-{layout}"
    args = ["--dtype", dtype, "--preemption-mode", PREEMPTION_MODES[dtype], *SCHEDULING_ARGS]
    with run_layout(layout, folder, redis_url, tmp_path, cluster=cluster, extra_args=args) as mesh:
        info = mesh.stub.GetModelInfo(generate_pb2.GetModelInfoRequest())
        assert info.dtype == dtype
        mesh.generate(greedy_request(prompts[0], MAX_TOKENS))  # its prefix is cached now
        runs = []
        for _ in range(3):  # again while no request was preempted: arrival is timing's
            with ThreadPoolExecutor(len(prompts)) as pool:
                runs.append(
                    list(
                        pool.map(
                            lambda p: mesh.generate(
                                greedy_request(p, MAX_TOKENS, logprobs=NUM_TOP_LOGPROBS)
                            ),
                            prompts,
                        )
                    )
                )
            stats = scheduler_stats(redis_url, cluster)
            if stats.num_preemptions:
                break

    worst, near_ties = 0.0, 0
    for result, reference in ((r, ref) for results in runs for r, ref in zip(results, references)):
        assert result.finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert all(len(entry.top) == NUM_TOP_LOGPROBS for entry in result.logprobs)
        worst = max(
            worst, assert_half_precision_close(result.token_ids, list(result.logprobs), reference)
        )
        near_ties += first_divergence(result.token_ids, reference.tokens) is not None
    print(
        f"{dtype} {layout} {arch}: worst logprob difference {worst:.2e} "
        f"(bound {references[0].logprob_bound:.2e}), "
        f"{near_ties} of {sum(map(len, runs))} streams parted at a near-tie; "
        f"{stats.num_preemptions} preemptions, prefix hit rate {stats.prefix_cache_hit_rate:.2f}"
    )
    assert stats.prefix_cache_hit_rate > 0, stats
    assert stats.num_preemptions > 0, "the cache was meant to run out"
    swapped = stats.num_preemptions if PREEMPTION_MODES[dtype] == "swap" else 0
    assert stats.num_swap_outs == swapped == stats.num_swap_ins, stats
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0, stats
