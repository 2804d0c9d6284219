"""Loading from HF folders and GGUF files, model metadata, KV sizing, backend choice."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.cpu_features import CpuFeatures, cpu_features
from pagemesh.tools.testing.tiny_models import write_tiny_model
from protos.step import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from worker_svc.attention import TorchAttentionBackend, get_attention_backend
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches, num_blocks_for_budget
from worker_svc.loader import load_model, open_source, resolve_dtype
from worker_svc.model.config import parse_hf_config
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.runner import ModelRunner
from worker_svc.runner_config import RunnerConfig

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def tiny_llama3_tied(tmp_path_factory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("llama3_tied"), "llama", llama3_rope=True, tie_word_embeddings=True
    )


def our_tensor(model: LlamaForCausalLM, hf_name: str) -> torch.Tensor:
    """The slice of our (possibly fused) parameter that holds HF tensor `hf_name`."""
    parts = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    module_path, _, param_name = hf_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    if hf_name == "lm_head.weight" and model.lm_head is None:
        return model.model.embed_tokens.weight
    if leaf not in parts:
        return model.get_parameter(hf_name)
    fused, part = parts[leaf]
    module = model.get_submodule(f"{parent}.{fused}")
    start, size = module.part_offsets[part], module.part_sizes[part]
    return getattr(module, param_name)[start : start + size]


def assert_weights_equal(model: LlamaForCausalLM, hf_state: dict[str, torch.Tensor]) -> None:
    for name, tensor in hf_state.items():
        torch.testing.assert_close(
            our_tensor(model, name).float(),
            tensor.float(),
            rtol=0,
            atol=0,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def greedy_tokens(runner: ModelRunner, prompt: list[int], num_new_tokens: int) -> list[int]:
    num_blocks = -(-(len(prompt) + num_new_tokens) // runner.block_size)
    new = NewRequestData("r", list(prompt), len(prompt), list(range(num_blocks)), 0, GREEDY)
    output = runner.execute_step(SchedulerOutput(0, [new], num_scheduled_tokens={"r": len(prompt)}))
    tokens = [output.sampled["r"].token_id]
    for i in range(1, num_new_tokens):
        cached = CachedRequestData("r", [], len(prompt) + i - 1, [tokens[-1]])
        output = runner.execute_step(
            SchedulerOutput(i, cached_requests=[cached], num_scheduled_tokens={"r": 1})
        )
        tokens.append(output.sampled["r"].token_id)
    return tokens


# --- Hugging Face folders -------------------------------------------------------------


def test_transformers4_and_5_rope_spellings_agree(tiny_llama3_tied: Path) -> None:
    tf5 = json.loads((tiny_llama3_tied / "config.json").read_text())
    tf4 = {k: v for k, v in tf5.items() if k != "rope_parameters"}
    rope = dict(tf5["rope_parameters"])
    tf4["rope_theta"] = rope.pop("rope_theta")
    tf4["rope_scaling"] = rope
    assert parse_hf_config(tf4) == parse_hf_config(tf5)
    assert parse_hf_config(tf5).rope.rope_type == "llama3"
    assert parse_hf_config(tf5).rope.original_max_position_embeddings == 64


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope type 'yarn'"),
        ({"model_type": "gpt2"}, "model type 'gpt2'"),
        ({"hidden_act": "gelu"}, "SiLU"),
    ],
)
def test_unsupported_configs_are_rejected(tiny_llama: Path, change: dict, message: str) -> None:
    hf_config = json.loads((tiny_llama / "config.json").read_text())
    hf_config.pop("rope_parameters")
    with pytest.raises(ValueError, match=message):
        parse_hf_config({**hf_config, **change})


@pytest.mark.parametrize(
    "config, named",
    [
        # Vision-language models other than LLaVA: the decoder's keys in a nested text_config
        # crashed the worker with KeyError: 'num_attention_heads'.
        (
            {
                "architectures": ["Qwen2_5_VLForConditionalGeneration"],
                "model_type": "qwen2_5_vl",
                "text_config": {"model_type": "qwen2_5_vl_text", "num_attention_heads": 4},
            },
            "Qwen2_5_VLForConditionalGeneration",
        ),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
        (
            {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama"},
            "LlamaForSequenceClassification",
        ),
    ],
)
def test_a_folder_it_cannot_build_is_refused_naming_its_architecture(
    tmp_path: Path, config: dict, named: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"architecture {named} .* is not served here"):
        open_source(tmp_path)


def test_a_llava_whose_language_model_is_not_served_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlavaForConditionalGeneration"],
                "model_type": "llava",
                "text_config": {"model_type": "gemma"},
            }
        )
    )
    with pytest.raises(ValueError, match="language model is 'gemma'"):
        open_source(tmp_path)


def test_qwen2_sliding_window_layers_follow_max_window_layers() -> None:
    base = {
        "model_type": "qwen2",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "sliding_window": 16,
        "max_window_layers": 2,
    }
    assert parse_hf_config(base).sliding_windows == (None,) * 4
    windows = parse_hf_config({**base, "use_sliding_window": True}).sliding_windows
    assert windows == (None, None, 16, 16)


@pytest.mark.parametrize("sharded", [False, True])
def test_safetensors_weights_match_transformers(tmp_path: Path, sharded: bool) -> None:
    path = write_tiny_model(tmp_path, "qwen2", max_shard_size="60KB" if sharded else None)
    assert (path / "model.safetensors.index.json").is_file() == sharded
    model, metadata = load_model(path)
    assert_weights_equal(model, hf_state_dict(path))
    assert metadata.architecture == "Qwen2ForCausalLM"
    assert metadata.dtype == torch.float32 and metadata.max_model_len == 512


def test_metadata_eos_ids_and_max_model_len(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "llama")
    generation_config = json.loads((path / "generation_config.json").read_text())
    generation_config["eos_token_id"] = [0, 5]
    (path / "generation_config.json").write_text(json.dumps(generation_config))
    _, metadata = load_model(path, max_model_len=100)
    assert metadata.eos_token_ids == (0, 5) and metadata.max_model_len == 100
    assert metadata.name == path.name and metadata.vocab_size == 512
    with pytest.raises(ValueError, match="max_model_len=1000"):
        load_model(path, max_model_len=1000)
    with pytest.raises(FileNotFoundError):
        load_model(path / "nowhere")


def test_checkpoints_say_their_stored_dtype(tiny_llama: Path, tmp_path: Path) -> None:
    assert open_source(tiny_llama).stored_dtype == torch.float32  # config.json's dtype
    assert (
        open_source(write_tiny_gguf(tiny_llama, tmp_path / "f32.gguf")).stored_dtype
        == torch.float32
    )
    # The tiny checkpoints are fp32, so auto is fp32 on every CPU and matches transformers'.
    assert load_model(tiny_llama)[1].dtype == torch.float32


def test_bfloat16_weights_keep_fp32_rotary(tiny_llama: Path) -> None:
    model, metadata = load_model(tiny_llama, dtype="bfloat16")
    assert metadata.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary.cos_cache.dtype == torch.float32


def _cpu(flags: tuple[str, ...], onednn_bf16: bool) -> CpuFeatures:
    return CpuFeatures(
        model="test CPU",
        arch="x86_64",
        flags=flags,
        torch_version="2.13.0",
        torch_cpu_capability="AVX2",
        onednn_fp32_linear=True,
        onednn_bf16_linear=onednn_bf16,
    )


def test_resolve_dtype() -> None:
    zen3 = _cpu(("avx2", "fma"), onednn_bf16=False)
    skylake = _cpu(("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"), onednn_bf16=True)
    zen4 = _cpu(
        ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"), onednn_bf16=True
    )
    bf16, fp32 = torch.bfloat16, torch.float32
    # auto on CPU: bf16 only where it is native and oneDNN runs it, and the checkpoint is
    # not fp32; emulated bf16 (AVX2, AVX-512 without BF16) is slower than fp32.
    for stored in (bf16, torch.float16, None):
        assert resolve_dtype("auto", "cpu", stored, zen4) == bf16
        assert resolve_dtype("auto", "cpu", stored, zen3) == fp32
        assert resolve_dtype("auto", "cpu", stored, skylake) == fp32
    assert resolve_dtype("auto", "cpu", fp32, zen4) == fp32
    assert resolve_dtype("auto", "cpu", bf16, _cpu(("avx512_bf16",), onednn_bf16=False)) == fp32
    here = cpu_features()
    assert resolve_dtype("auto", "cpu", bf16) == (
        bf16 if here.native_bf16 and here.onednn_bf16_linear else fp32
    )
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")


# --- KV cache sizing and backend choice -----------------------------------------------


def test_kv_cache_sizing() -> None:
    spec = KVCacheSpec(
        num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16
    )
    assert spec.bytes_per_block == 3 * 2 * 16 * 2 * 8 * 2
    assert num_blocks_for_budget(spec, 10 * spec.bytes_per_block + 5) == 10
    assert num_blocks_for_budget(spec, 1, num_blocks_override=7) == 7
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(spec, spec.bytes_per_block - 1)
    caches = allocate_kv_caches(spec, 4, "cpu")
    assert len(caches) == 3 and caches[0].shape == (2, 4, 16, 2, 8)
    assert caches[0].dtype == torch.bfloat16 and not caches[0].any()


def test_runner_sizes_cache_from_budget(tiny_llama: Path) -> None:
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(tiny_llama), block_size=8, kv_cache_memory_bytes=1 << 20)
    )
    info = runner.info()
    bytes_per_block = info.num_layers * 2 * 8 * info.num_kv_heads * info.head_dim * 4
    assert info.num_blocks == (1 << 20) // bytes_per_block
    assert (info.block_size, info.dtype, info.hidden_size) == (8, "float32", 64)


def test_attention_backend_choice() -> None:
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert get_attention_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flash", "cpu")


# --- GGUF -------------------------------------------------------------------------------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (its LlamaModel.permute)."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_to_gguf_name(name: str) -> str:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in globals_:
        return globals_[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, param = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{param}"


def add_gguf_header(writer, config: dict) -> None:
    """The shape keys llama.cpp's converter writes for a Llama-family config.json (the
    caller adds its name, vocabulary, tokens and architecture's own keys)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])


def write_tiny_gguf(hf_path: Path, out: Path, *, quantize_embedding: bool = False) -> Path:
    """Convert a tiny HF llama to GGUF the way llama.cpp does (F32, permuted q/k)."""
    import gguf

    config = json.loads((hf_path / "config.json").read_text())
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // num_heads
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny")
    add_gguf_header(writer, config)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config["rope_parameters"]["rope_type"] == "llama3":
        from transformers import AutoConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(hf_path), "cpu")
        base = 1.0 / (
            config["rope_parameters"]["rope_theta"]
            ** (torch.arange(0, head_dim, 2).float() / head_dim)
        )
        writer.add_tensor("rope_freqs.weight", (base / scaled).numpy().astype(np.float32))
    for name, tensor in hf_state_dict(hf_path).items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        array = tensor.numpy().astype(np.float32)
        if name.endswith("self_attn.q_proj.weight"):
            array = llama_cpp_permute(array, num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = llama_cpp_permute(array, num_kv_heads)
        if quantize_embedding and name == "model.embed_tokens.weight":
            quantized = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                hf_to_gguf_name(name), quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(hf_to_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("variant", ["llama", "llama3_tied"])
def test_gguf_matches_hf_weights_and_tokens(
    variant: str, tiny_llama: Path, tiny_llama3_tied: Path, tmp_path: Path
) -> None:
    hf_path = tiny_llama if variant == "llama" else tiny_llama3_tied
    gguf_path = write_tiny_gguf(hf_path, tmp_path / "tiny.gguf")
    model, metadata = load_model(gguf_path)
    hf_state = hf_state_dict(hf_path)
    assert_weights_equal(model, hf_state)
    assert (model.lm_head is None) == (variant == "llama3_tied")
    assert metadata.eos_token_ids == (0,) and metadata.max_model_len == 512
    assert metadata.architecture == "LlamaForCausalLM" and metadata.name == "tiny"
    if variant == "llama3_tied":  # llama3 scaling arrives as per-frequency divisors
        assert model.config.rope.freq_divisors is not None
        hf_model, _ = load_model(hf_path)
        torch.testing.assert_close(model.model.rotary.cos_cache, hf_model.model.rotary.cos_cache)

    prompt = list(range(3, 40, 3))
    config = RunnerConfig(model_path="", block_size=4, num_blocks=16)
    runners = [
        ModelRunner.from_config(RunnerConfig(**{**config.__dict__, "model_path": str(p)}))
        for p in (hf_path, gguf_path)
    ]
    assert greedy_tokens(runners[0], prompt, 10) == greedy_tokens(runners[1], prompt, 10)


def test_gguf_quantized_embedding_dequantizes(tiny_llama: Path, tmp_path: Path) -> None:
    import gguf

    gguf_path = write_tiny_gguf(tiny_llama, tmp_path / "q8.gguf", quantize_embedding=True)
    model, _ = load_model(gguf_path)
    embedding = hf_state_dict(tiny_llama)["model.embed_tokens.weight"].numpy()
    quantized = gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(quantized, gguf.GGMLQuantizationType.Q8_0)
    torch.testing.assert_close(
        model.model.embed_tokens.weight, torch.from_numpy(expected), rtol=0, atol=0
    )
    assert not torch.equal(model.model.embed_tokens.weight, torch.from_numpy(embedding))


def smollm2_chat_prompt(tokenizer) -> list[int]:
    """A chat prompt for the default model whose answer names Paris."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]


def test_default_smollm2_gguf_matches_transformers(smollm2_gguf: Path, smollm2_hf: tuple) -> None:
    path = smollm2_gguf
    hf_model, tokenizer = smollm2_hf
    prompt = smollm2_chat_prompt(tokenizer)
    num_new_tokens = 20
    # fp32 named: the reference is fp32, and auto is bf16 on a CPU with native bf16.
    runner = ModelRunner.from_config(
        RunnerConfig(model_path=str(path), num_blocks=8, dtype="float32")
    )
    info = runner.info()
    assert info.architecture == "LlamaForCausalLM"
    assert (info.eos_token_ids, info.max_model_len) == ((2,), 8192)
    ours = greedy_tokens(runner, prompt, num_new_tokens)

    hf_state = hf_model.state_dict()
    # The runner packs its linear weights for oneDNN (freeing the plain ones): compare what
    # the loader reads.
    loaded, _ = load_model(str(path), dtype="float32")
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.weight",
        "model.embed_tokens.weight",
    ):
        torch.testing.assert_close(our_tensor(loaded, name), hf_state[name], rtol=0, atol=0)
    # eos ignored on both sides: the runner never stops by itself (the scheduler does).
    out = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=num_new_tokens, do_sample=False, eos_token_id=None
    )
    assert ours == out[0, len(prompt) :].tolist()
    assert "Paris" in tokenizer.decode(ours)
    # What `make run` computes in: the quantized default model follows the CPU.
    assert open_source(path).stored_dtype is None
    assert load_model(str(path))[1].dtype == resolve_dtype("auto", "cpu", None)
