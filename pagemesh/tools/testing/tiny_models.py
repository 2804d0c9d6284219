"""Tiny random Llama-family checkpoints, for tests and benchmarks.

`write_tiny_model(path, arch)` saves a transformers model folder (config.json,
model.safetensors, generation_config.json) plus a byte-level BPE tokenizer trained on a
fixed English text. Two weight scales:

- `PEAKY_STD` (the default, 0.4): greedy steps have top-2 logits well apart, so HF and
  pagemesh agree token for token; for tests of plumbing, where a near-tie would be noise.
- realistic (`write_realistic_model`): weights of std 0.02, as trained checkpoints have, so
  logits lie close and near-ties really occur; and query/key projections of std 0.2, so
  attention is as peaked as a trained model's (the mean row's largest weight is ~0.6, not
  the ~0.14 of uniform-ish attention that std 0.02 alone gives). A small numerical error
  then moves logprobs past the fp32 bound: a norm epsilon x10 by ~1e-2, a rotary theta +1%
  by ~2e-3 (which attention at std 0.02 would shrink to 1e-5). For the tests of numerical
  parity.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged key value cache stores the keys and
values of every token in fixed size blocks, so that many requests can share one pool of
memory without fragmentation. The scheduler decides which requests run in each step; the
worker runs the model over all scheduled tokens at once and samples the next token for
every request that has reached the end of its prompt. Paris is the capital of France,
Berlin is the capital of Germany, and Rome is the capital of Italy. What is the weather
like today? It is sunny with a light breeze from the west, and the temperature is mild.
Large language models predict one token at a time. Continuous batching lets new requests
join a running batch between steps, and chunked prefill splits a long prompt into pieces
so that decoding requests are not starved. Tensor parallelism shards each matrix across
devices; pipeline parallelism gives each device a contiguous range of layers.
Once upon a time there was a little robot who loved to count numbers: one, two, three,
four, five, six, seven, eight, nine, ten. Every morning it said hello to the sun and
asked its friends how they were doing. They answered: we are fine, thank you very much!
"""

_ARCH_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}),  # != hidden / heads, as real Qwen3 does
    # Mixture of experts: 8 experts, 2 per token, as Mixtral; Qwen's experts narrower than the
    # dense MLP, as theirs are, with one dense layer (`mlp_only_layers`).
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
            "norm_topk_prob": False,
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "head_dim": 24,
            "norm_topk_prob": True,
        },
    ),
}
PEAKY_STD = 0.4
REALISTIC_STD = 0.02
REALISTIC_ATTENTION_STD = 0.2  # query and key projections
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small so the scaled band covers the tiny head_dim's frequencies.
    "original_max_position_embeddings": 64,
}


def train_tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer


def _write_tokenizer(path: Path, vocab_size: int) -> int:
    tokenizer = train_tiny_tokenizer(vocab_size)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tokenizer.get_vocab_size()


def _randomise(model: torch.nn.Module, seed: int, std: float, attention_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                # Around 1 so layers keep their scale, but not 1 so norm loading is tested.
                param.copy_(1.0 + 0.2 * noise)
            elif "q_proj" in name or "k_proj" in name:
                param.copy_(attention_std * noise)
            else:
                param.copy_(std * noise)


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    tie_word_embeddings: bool = False,
    llama3_rope: bool = False,
    std: float = PEAKY_STD,
    attention_std: float | None = None,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random `arch` model + tokenizer to `path`; deterministic given `seed`.
    `std`: the weights' standard deviation (norms excepted, drawn around 1);
    `attention_std`: the query and key projections' (None: `std`)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    eos_token_id = 0  # the tokenizer's only special token comes first
    vocab_size = _write_tokenizer(path, 512)
    config_class_name, arch_defaults = _ARCH_CONFIGS[arch]
    config_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": eos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        **arch_defaults,
    }
    if llama3_rope:
        config_kwargs["rope_parameters"] = dict(LLAMA3_ROPE)
    config_kwargs.update(overrides)
    config = getattr(transformers, config_class_name)(**config_kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model, seed, std, std if attention_std is None else attention_std)
    save_kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **save_kwargs)
    return path


def write_realistic_model(
    path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """`write_tiny_model` at a trained checkpoint's scales (see the module's docstring):
    for the tests of numerical parity with transformers."""
    return write_tiny_model(
        path, arch, seed, std=REALISTIC_STD, attention_std=REALISTIC_ATTENTION_STD, **overrides
    )
