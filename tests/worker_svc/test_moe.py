"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers, and the
grouped-experts kernel against transformers' per-expert loop.

The models are written at a trained checkpoint's scales (`write_realistic_model`: router
logits close together, so the top-k choice is sensitive), 8 experts top-2, 3 layers (Qwen2-MoE
with its middle layer dense and a gated shared expert), plus an odd expert count. The runner
is driven through the scripted continuous-batching schedule (chunked prefills, requests
joining late) and must give transformers' greedy tokens and its logprobs within the fp32
bound; bf16 within the bound derived from transformers' own rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import moe as moe_kernels
from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.step import SamplingParams
from tests.support.hf_reference import (
    assert_half_precision_close,
    assert_logprobs_close,
    half_precision_references,
    hf_greedy_with_logits,
)
from tests.support.runner_script import BLOCK_SIZE, NUM_NEW_TOKENS, drive, scripted_requests
from tests.worker_svc.test_runner_vs_hf import _as_token_logprob
from worker_svc.model.config import parse_hf_config
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

LOGPROBS = SamplingParams(temperature=0.0, num_logprobs=5)
MOE_MODELS = {
    "mixtral": dict(arch="mixtral"),
    "qwen2_moe": dict(arch="qwen2_moe"),  # shared expert, layer 1 dense, no renormalising
    "qwen3_moe": dict(arch="qwen3_moe"),  # q/k norms, renormalised top-k
    "qwen3_moe_7_experts_top3": dict(arch="qwen3_moe", num_experts=7, num_experts_per_tok=3),
}


def runner_for(path: Path, **overrides) -> ModelRunner:
    return ModelRunner.from_config(
        RunnerConfig(model_path=str(path), block_size=BLOCK_SIZE, num_blocks=48, **overrides)
    )


def check_against_transformers(path: Path, runner: ModelRunner) -> None:
    from transformers import AutoModelForCausalLM

    requests = scripted_requests(runner.info().vocab_size, late_joiner=False)
    drive(runner, requests, NUM_NEW_TOKENS, LOGPROBS)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for r in requests:
        assert_logprobs_close(
            r.outputs,
            [_as_token_logprob(s) for s in r.sampled],
            *hf_greedy_with_logits(hf_model, r.prompt, NUM_NEW_TOKENS),
        )


@pytest.mark.parametrize("name", list(MOE_MODELS))
def test_moe_models_match_transformers_tokens_and_logprobs(name: str, tmp_path: Path) -> None:
    path = write_realistic_model(tmp_path / name, seed=5, **MOE_MODELS[name])
    check_against_transformers(path, runner_for(path))


def test_moe_through_torch_linear_matches_too(tmp_path: Path) -> None:
    """The experts unpacked (`--cpu-linear torch`: plain 3-D weights through F.linear)."""
    path = write_realistic_model(tmp_path / "m", "qwen2_moe", seed=6)
    check_against_transformers(path, runner_for(path, cpu_linear="torch"))


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_moe_half_precision_within_transformers_rounding(dtype: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = write_realistic_model(tmp_path / "m", "mixtral", seed=7)
    runner = runner_for(path, dtype=dtype)
    requests = scripted_requests(runner.info().vocab_size, late_joiner=False)[:3]
    drive(runner, requests, NUM_NEW_TOKENS, LOGPROBS)
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_half = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    references = half_precision_references(
        hf32, hf_half, [r.prompt for r in requests], NUM_NEW_TOKENS
    )
    for r, reference in zip(requests, references, strict=True):
        assert_half_precision_close(r.outputs, [_as_token_logprob(s) for s in r.sampled], reference)


def test_router_tie_goes_to_the_lower_expert_as_in_transformers(tmp_path: Path) -> None:
    """Two experts with identical router rows tie exactly on every token; with top-2 and a
    third expert always ahead, one of the two must be chosen: torch.topk keeps the lower
    index first on CPU, in transformers' router and in ours (`kernels.moe.route`), so both
    pick the same expert and the tokens and logprobs agree."""
    from transformers import AutoModelForCausalLM

    path = write_realistic_model(tmp_path / "m", "qwen3_moe", seed=8)
    weights = load_file(path / "model.safetensors")
    for layer in range(3):
        gate = weights[f"model.layers.{layer}.mlp.gate.weight"]
        gate[0] = gate[5] * 50  # expert 0 ahead of every other
        gate[2] = gate[6]  # experts 2 and 6 tie, and ahead of the rest
        gate[2] *= 20
        gate[6] = gate[2]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hidden = torch.randn(16, 64)
    gate = hf.model.layers[0].mlp.gate
    _, _, hf_ids = gate(hidden)
    _, ids = moe_kernels.route(
        torch.nn.functional.linear(hidden, gate.weight), 2, True, torch.float32
    )
    assert torch.equal(ids, hf_ids)
    check_against_transformers(path, runner_for(path))


def _random_experts(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    hidden, inter = 48, 40

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    logits = torch.randn(tokens, experts, generator=generator)
    weights, ids = moe_kernels.route(logits, top_k, True, dtype)
    return (
        randn(tokens, hidden),
        randn(experts, 2 * inter, hidden) * 0.1,
        randn(experts, hidden, inter) * 0.1,
        weights,
        ids,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(64, 8, 2), (5, 7, 3), (1, 3, 1)])
def test_grouped_experts_equal_transformers_loop(tokens, experts, top_k, dtype):
    """One sort + one GEMM pair per expert + one weighted index_add_ sums in transformers'
    order (experts ascending): fp32 bit for bit; in bf16 index_add_ rounds a token's sum once
    where transformers rounds per expert, about one bf16 unit apart (values here ~0.1-1)."""
    args = _random_experts(tokens, experts, top_k, dtype, seed=tokens)
    ours, theirs = moe_kernels.fused_experts(*args), moe_kernels.per_expert_loop(*args)
    if dtype == torch.float32:
        assert torch.equal(ours, theirs)
    else:
        torch.testing.assert_close(ours, theirs, rtol=1.6e-2, atol=4e-3)


def test_experts_of_another_rank_contribute_nothing() -> None:
    hidden, w13, w2, weights, ids = _random_experts(9, 6, 2, torch.float32, seed=3)
    remote = ids.clone()
    remote[remote >= 3] = -1  # experts 3..5 held elsewhere
    local_only = weights * (ids < 3)
    expected = moe_kernels.per_expert_loop(hidden, w13, w2, local_only, ids)
    torch.testing.assert_close(
        moe_kernels.fused_experts(hidden, w13, w2, weights, remote), expected
    )
    nobody = torch.full_like(ids, -1)
    assert torch.equal(
        moe_kernels.fused_experts(hidden, w13, w2, weights, nobody), torch.zeros_like(hidden)
    )


def test_moe_config_follows_transformers_layer_rules() -> None:
    base = json.loads(
        json.dumps(
            dict(
                model_type="qwen2_moe",
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=6,
                num_attention_heads=2,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                shared_expert_intermediate_size=16,
                decoder_sparse_step=2,
                mlp_only_layers=[3],
            )
        )
    )
    moe = parse_hf_config(base).moe
    # sparse where (i + 1) % 2 == 0 and i not in mlp_only_layers
    assert moe.sparse_layers == (False, True, False, False, False, True)
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (4, 2, False)
    assert parse_hf_config(base).qkv_bias and not parse_hf_config(base).o_proj_bias
    with pytest.raises(ValueError, match="experts per token"):
        parse_hf_config(base | {"num_experts_per_tok": 5})


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(64, 8, 2), (5, 7, 3), (1, 3, 1), (0, 4, 2)]
)
def test_one_c_call_equals_transformers_loop(tokens, experts, top_k):
    """`FusedExperts` packed for the C kernel (`cpu_linear.moe_f32`: sort, per-expert panels,
    SiLU-and-mul, the weighted sum experts ascending) against transformers' loop; an expert
    another rank holds (-1) adds nothing."""
    from kernels import cpu_native
    from worker_svc.model.moe import FusedExperts
    from worker_svc.parallel import ParallelConfig

    if cpu_native.library("cpu_linear") is None:
        pytest.skip("no C compiler here: the torch path is what runs")
    hidden, w13, w2, weights, ids = _random_experts(tokens, experts, top_k, torch.float32, 9)
    module = FusedExperts(experts, hidden.shape[1], w2.shape[2], ParallelConfig())
    module.w13.data.copy_(w13)
    module.w2.data.copy_(w2)
    module.pack_experts("native")
    assert module.native is not None and module.w13.numel() == 0
    torch.testing.assert_close(
        module(hidden, weights, ids),
        moe_kernels.fused_experts(hidden, w13, w2, weights, ids),
        rtol=1e-5,
        atol=1e-6,
    )
    remote = torch.where(ids >= 2, -1, ids)
    torch.testing.assert_close(
        module(hidden, weights, remote),
        moe_kernels.fused_experts(hidden, w13, w2, weights, remote),
        rtol=1e-5,
        atol=1e-6,
    )


def test_expert_placement_is_a_table_and_uneven_counts_go_to_the_first_ranks(tmp_path):
    from worker_svc.loader import rank_weight_shapes
    from worker_svc.model.moe import ExpertPlacement
    from worker_svc.parallel import ParallelConfig

    placement = ExpertPlacement.contiguous(7, 2)
    assert placement.owner == (0, 0, 0, 0, 1, 1, 1)
    assert (placement.experts_of(0), placement.experts_of(1)) == ([0, 1, 2, 3], [4, 5, 6])
    with pytest.raises(ValueError, match="at least as many experts"):
        ExpertPlacement.contiguous(3, 4)
    path = write_realistic_model(tmp_path / "m", "qwen3_moe", num_experts=7)
    experts = "model.layers.0.mlp.experts.w13"
    for rank, held in ((0, 4), (1, 3)):
        shapes = rank_weight_shapes(path, ParallelConfig(2, rank, expert_parallel=True))
        assert shapes[experts] == (held, 2 * 48, 64)  # whole experts
        sliced = rank_weight_shapes(path, ParallelConfig(2, rank))
        assert sliced[experts] == (7, 48, 64)  # every expert, half its columns


def test_balanced_placement_evens_the_load_and_keeps_each_ranks_expert_count():
    from worker_svc.model.expert_balance import balanced_placement

    # Experts 0 and 1 are hot and contiguous placement gives both to rank 0.
    loads = [40.0, 35.0, 5.0, 5.0, 5.0, 5.0, 4.0]
    placement = balanced_placement(loads, 2)
    held = [placement.experts_of(rank) for rank in (0, 1)]
    assert [len(h) for h in held] == [4, 3]  # as ExpertPlacement.contiguous(7, 2)
    assert placement.owner[0] != placement.owner[1]  # the two hot experts part
    totals = sorted(sum(loads[e] for e in h) for h in held)
    assert totals[1] - totals[0] <= 6  # 49 / 50 against 85 / 14 before
    assert balanced_placement(loads, 2) == placement  # every rank computes the same table
    assert balanced_placement([0.0] * 7, 2) == balanced_placement([0.0] * 7, 2)


def test_layouts_a_moe_model_cannot_take_are_refused_naming_the_counts():
    from worker_svc.model.parallel_layers import check_tensor_parallel

    config = parse_hf_config(
        dict(
            model_type="qwen3_moe",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=3,
            num_experts_per_tok=2,
            moe_intermediate_size=6,
        )
    )
    check_tensor_parallel(config, 2)  # 6 columns of each expert split 3 + 3
    with pytest.raises(
        ValueError,
        match=r"moe_intermediate_size \(6\) must be divisible by "
        r"tp_size \(4\)",
    ):
        check_tensor_parallel(config, 4)
    check_tensor_parallel(config, 2, expert_parallel=True)  # experts 0-1 and 2
    with pytest.raises(ValueError, match="over 4 ranks needs at least 4 experts; the model has 3"):
        check_tensor_parallel(config, 4, expert_parallel=True)


# --- GGUF -------------------------------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{
        f"mlp.shared_expert.{p}_proj.weight": f"ffn_{p}_shexp.weight"
        for p in ("gate", "up", "down")
    },
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
}


def write_moe_gguf(hf_path: Path, out: Path, arch: str, quantize: str | None = None) -> Path:
    """A HF MoE folder as llama.cpp's converter writes it (F32, or its projections and
    experts in `quantize`, e.g. "Q8_0"): experts stacked into `ffn_*_exps` [experts, out,
    in]; arch "llama" (Mixtral) permutes q/k rows."""
    import gguf
    import numpy as np

    from tests.worker_svc.test_loader import add_gguf_header, llama_cpp_permute

    config = json.loads((hf_path / "config.json").read_text())
    tensors = {
        k: v.numpy().astype(np.float32) for k, v in load_file(hf_path / "model.safetensors").items()
    }
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_experts = config.get("num_local_experts") or config["num_experts"]
    writer = gguf.GGUFWriter(str(out), arch)
    add_gguf_header(writer, config)
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_expert_count(num_experts)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if arch != "llama":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }

    def add(name: str, array: np.ndarray, linear: bool) -> None:
        if quantize is None or not linear:
            writer.add_tensor(name, array)
            return
        kind = getattr(gguf.GGMLQuantizationType, quantize)
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)

    for name, array in tensors.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if name in globals_:
            writer.add_tensor(globals_[name], array)
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:
            continue  # stacked below
        if arch == "llama" and rest == "self_attn.q_proj.weight":
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and rest == "self_attn.k_proj.weight":
            array = llama_cpp_permute(array, kv_heads)
        add(
            f"blk.{layer}.{_GGUF_LAYER[rest]}",
            array,
            rest.endswith("_proj.weight") and ".shared_expert_gate" not in rest,
        )
    for layer in range(config["num_hidden_layers"]):
        for part, mixtral in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            names = [
                f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight"
                for e in range(num_experts)
            ]
            if arch == "llama":
                names = [
                    f"model.layers.{layer}.block_sparse_moe.experts.{e}.{mixtral}.weight"
                    for e in range(num_experts)
                ]
            if names[0] in tensors:
                add(
                    f"blk.{layer}.ffn_{part}_exps.weight",
                    np.stack([tensors[n] for n in names]),
                    True,
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("arch", "gguf_arch"),
    [("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"), ("mixtral", "llama")],
)
def test_a_gguf_moe_loads_the_same_model_as_its_hf_folder(arch, gguf_arch, tmp_path):
    """Expert tensors stacked as llama.cpp stores them (`ffn_*_exps`), the router, the shared
    expert and its gate, dense layers among sparse ones: the same config and weights."""
    from worker_svc.loader import load_model

    hf_path = write_realistic_model(tmp_path / arch, arch, seed=12)
    gguf_path = write_moe_gguf(hf_path, tmp_path / f"{arch}.gguf", gguf_arch)
    ours, metadata = load_model(gguf_path, dtype="float32")
    reference, _ = load_model(hf_path, dtype="float32")
    assert ours.config.moe == reference.config.moe
    assert metadata.architecture == reference_architecture(arch)
    theirs = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        assert torch.equal(param, theirs[name]), name


def reference_architecture(arch: str) -> str:
    return {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
    }[arch]


def test_gguf_experts_kept_quantized_give_the_dequantized_models_tokens(tmp_path):
    """--gguf-keep-quantized on a Q8_0 Qwen3-MoE GGUF: each expert's gate|up and down stay
    blocks (one GgufWeight each, multiplied by the C GGUF kernel at decode), and the tokens
    and logprobs are those of the same file dequantized at load."""
    from worker_svc.quant.gguf import GgufWeight

    hf_path = write_realistic_model(tmp_path / "m", "qwen3_moe", seed=13, moe_intermediate_size=64)
    gguf_path = write_moe_gguf(hf_path, tmp_path / "m.gguf", "qwen3moe", quantize="Q8_0")
    runs = {}
    for kept in (False, True):
        runner = runner_for(gguf_path, dtype="float32", gguf_keep_quantized=kept)
        requests = scripted_requests(runner.info().vocab_size, late_joiner=False)
        drive(runner, requests, NUM_NEW_TOKENS, LOGPROBS)
        runs[kept] = requests
        experts = runner.model.model.layers[0].mlp.experts
        as_blocks = experts.packed is not None and isinstance(experts.packed[0][0], GgufWeight)
        assert as_blocks == kept
    assert runner.metadata.quantization == "gguf-q8_0"
    for plain, kept in zip(runs[False], runs[True], strict=True):
        assert plain.outputs == kept.outputs
        for a, b in zip(plain.sampled, kept.sampled, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4
