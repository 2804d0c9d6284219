"""Packing linear weights for oneDNN (`worker_svc/model/matmul.py`)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn import functional as F

from kernels.cpu_features import cpu_features
from worker_svc.model.config import parse_hf_config
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.matmul import (
    NativeWeight,
    OneDnnWeight,
    native_linear_available,
    onednn_linear_available,
    pack_linear_weights,
    packed_weight_bytes,
    resolve_cpu_linear,
)

needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(torch.float32),
    reason="this torch build has no oneDNN linear kernels",
)


def tiny_llama(dtype: torch.dtype, tie: bool = True) -> LlamaForCausalLM:
    config = parse_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 100,
            "max_position_embeddings": 64,
            "tie_word_embeddings": tie,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    for param in model.parameters():
        param.data.normal_(0, 0.1)
    return model.eval()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layers_compute_what_f_linear_does(dtype):
    if not onednn_linear_available(dtype):
        pytest.skip(
            f"oneDNN {dtype} linear cannot run on this CPU "
            f"[{cpu_features().isa_summary}]: it needs avx512bw+avx512vl+avx512dq "
            "or avx_ne_convert"
        )
    model = tiny_llama(dtype)
    layers = [
        model.model.layers[0].self_attn.qkv_proj,
        model.model.layers[1].mlp.down_proj,
        model.model.embed_tokens,
    ]
    x = torch.randn(5, 64, dtype=dtype)
    x_mlp = torch.randn(5, 128, dtype=dtype)
    before = [layers[0](x), layers[1](x_mlp), model.model.embed_tokens.logits(x)]
    plain_bytes = packed_weight_bytes(model)
    assert pack_linear_weights(model, "onednn") == "onednn"
    after = [layers[0](x), layers[1](x_mlp), model.model.embed_tokens.logits(x)]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    # The linear layers' plain weights are freed; the tied embedding keeps its rows (lookups
    # read them) next to the packed LM head.
    assert layers[0].weight.numel() == 0 and isinstance(layers[0].packed_weight, OneDnnWeight)
    assert model.model.embed_tokens.weight.numel() == 100 * 64
    embed_bytes = 100 * 64 * torch.empty((), dtype=dtype).element_size()
    assert packed_weight_bytes(model) == plain_bytes + embed_bytes
    assert pack_linear_weights(model, "onednn") == "onednn"  # idempotent: nothing packed twice


@needs_onednn
def test_an_untied_embedding_is_not_packed():
    model = tiny_llama(torch.float32, tie=False)
    pack_linear_weights(model)
    assert model.model.embed_tokens.packed_weight is None
    assert model.lm_head.packed_weight is not None


def test_torch_choice_leaves_the_model_alone():
    model = tiny_llama(torch.float32)
    assert pack_linear_weights(model, "torch") == "torch"
    assert model.model.layers[0].mlp.gate_up_proj.packed_weight is None
    assert model.model.layers[0].mlp.gate_up_proj.weight.shape == (256, 64)


def test_bf16_auto_packs_only_where_onednn_runs_bf16():
    # On an AVX2-only CPU oneDNN's bf16 packing raises; auto must fall back, never raise.
    model = tiny_llama(torch.bfloat16)
    expected = "onednn" if cpu_features().onednn_bf16_linear else "torch"
    assert pack_linear_weights(model, "auto") == expected
    if expected == "torch":
        with pytest.raises(ValueError, match=re.escape(cpu_features().isa_summary)):
            resolve_cpu_linear("onednn", torch.device("cpu"), torch.bfloat16)


def test_choices_are_checked():
    with pytest.raises(ValueError, match="unknown cpu linear backend 'mkl'"):
        resolve_cpu_linear("mkl", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="needs a CPU device"):
        resolve_cpu_linear("onednn", torch.device("meta"), torch.float32)
    assert resolve_cpu_linear("auto", torch.device("cpu"), torch.float16) == "torch"


@pytest.mark.skipif(
    not native_linear_available(torch.float32),
    reason="no C compiler builds kernels/cpu_linear.c here",
)
def test_native_panels_compute_what_f_linear_does():
    """Every row count the kernel tiles differently (1-6, then 6-row tiles and a remainder,
    and prefill's wider tiles past 64 rows), widths that leave a thread two- and one-panel
    leftovers and a partial panel, a bias, and the model's layers once packed."""
    for rows, out_features, in_features in [
        (1, 576, 576),
        (2, 13, 64),
        (3, 8, 7),
        (4, 100, 33),
        (5, 9, 128),
        (6, 64, 64),
        (13, 250, 96),
        (0, 16, 8),
        (1, 200, 40),
        (70, 200, 40),
        (130, 216, 48),
    ]:
        weight = torch.randn(out_features, in_features)
        bias = torch.randn(out_features)
        x = torch.randn(rows, in_features)
        packed = NativeWeight(weight)
        expected = F.linear(x.double(), weight.double(), bias.double()).float()
        # fp32 sums in another order than the float64 reference: ~1e-5 of sqrt(k) terms.
        torch.testing.assert_close(packed.apply(x, bias), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(
            packed.apply(x[None], None)[0],
            F.linear(x.double(), weight.double()).float(),
            rtol=1e-4,
            atol=1e-4,
        )
    model = tiny_llama(torch.float32)
    x = torch.randn(5, 64)
    layer = model.model.layers[0].self_attn.qkv_proj
    before = [layer(x), model.model.embed_tokens.logits(x)]
    assert pack_linear_weights(model, "native") == "native"
    after = [layer(x), model.model.embed_tokens.logits(x)]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert layer.weight.numel() == 0 and isinstance(layer.packed_weight, NativeWeight)
    # Where it builds it is what auto picks for fp32 (16-wide panels on AVX-512, 8 on AVX2).
    assert resolve_cpu_linear("auto", torch.device("cpu"), torch.float32) == "native"
    with pytest.raises(ValueError, match="multiplies fp32 only"):
        resolve_cpu_linear("native", torch.device("cpu"), torch.bfloat16)
