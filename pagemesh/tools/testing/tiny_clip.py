"""A tiny random CLIPModel folder, for tests: transformers' own files, at trained scales.

`write_tiny_clip(path)` writes what a Hugging Face CLIP checkpoint holds: config.json
(CLIPModel, text and vision configs, projection_dim), model.safetensors (transformers'
names: `text_model.*`, `vision_model.*`, `text_projection.weight`,
`visual_projection.weight`, `logit_scale`), a BPE tokenizer with CLIP's special tokens
(`<|startoftext|>` and `<|endoftext|>`, the last two ids as in OpenAI's vocabulary, added
around every text by the post-processor), and preprocessor_config.json (CLIPImageProcessor
at the model's image size, CLIP's mean and std, bicubic).

Weights: embeddings and biases at std 0.02 and query/key projections at std 0.2 (as
tiny_models' realistic models: attention as peaked as a trained model's); the other matrices
(value, output, MLP, patch embedding, projections) at gain 1, std 1/sqrt(fan_in). At these
widths std 0.02 would make each residual branch add ~4% to its input, and the CLS state
would hardly depend on the image: random images' embeddings came out at cosine 0.998 to
each other; at gain 1 they are 0.6-0.8 apart, texts 0.2-0.6. Layer-norm weights lie around
1 with noise, so a norm loaded wrongly shows.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pagemesh.runtime.images import CLIP_MEAN, CLIP_STD
from pagemesh.tools.testing.tiny_models import REALISTIC_ATTENTION_STD, REALISTIC_STD, TRAINING_TEXT

BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
LOGIT_SCALE = math.log(1 / 0.07)  # CLIP's initial temperature
LAYER_NORM_NOISE = 0.1
_UNIT_GAIN_WEIGHTS = (
    "v_proj.weight",
    "out_proj.weight",
    "fc1.weight",
    "fc2.weight",
    "patch_embedding.weight",
    "text_projection.weight",
    "visual_projection.weight",
)


def train_clip_tokenizer(vocab_size: int = 400):
    """A lower-casing byte-level BPE (as CLIP's) trained on tiny_models' text, with the
    special tokens appended last and a template that wraps every text in them."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase()])
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    bos_id, eos_id = tokenizer.token_to_id(BOS_TOKEN), tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A {EOS_TOKEN}",
        pair=f"{BOS_TOKEN} $A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(BOS_TOKEN, bos_id), (EOS_TOKEN, eos_id)],
    )
    return tokenizer


def _write_tokenizer(path: Path, max_position_embeddings: int) -> tuple[int, int, int]:
    """Writes the tokenizer files; returns (vocab_size, bos_id, eos_id)."""
    tokenizer = train_clip_tokenizer()
    tokenizer.save(str(path / "tokenizer.json"))
    special = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_position_embeddings,
        **special,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return (
        tokenizer.get_vocab_size(),
        tokenizer.token_to_id(BOS_TOKEN),
        tokenizer.token_to_id(EOS_TOKEN),
    )


def _write_preprocessor(path: Path, image_size: int) -> None:
    config = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "resample": 3,
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
        "do_convert_rgb": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_norm = "norm" in name  # layer_norm1/2, final_layer_norm, pre_layrnorm, ...
            if name == "logit_scale":
                param.fill_(LOGIT_SCALE)
            elif is_norm and name.endswith(".weight"):
                param.copy_(1.0 + LAYER_NORM_NOISE * noise)
            elif ("q_proj" in name or "k_proj" in name) and name.endswith(".weight"):
                param.copy_(REALISTIC_ATTENTION_STD * noise)
            elif name.endswith(_UNIT_GAIN_WEIGHTS):
                param.copy_(noise / math.sqrt(param[0].numel()))  # std 1 / sqrt(fan_in)
            else:
                param.copy_(REALISTIC_STD * noise)


def write_tiny_clip(
    path: str | Path,
    seed: int = 0,
    *,
    text_layers: int = 2,
    vision_layers: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    hidden: int = 64,
    vision_hidden: int = 96,
    projection_dim: int = 32,
    num_heads: int = 4,
    hidden_act: str = "quick_gelu",
    max_position_embeddings: int = 77,
) -> Path:
    """Write a tiny random CLIPModel folder to `path`; deterministic given `seed`. The
    towers' widths differ (`hidden` for text, `vision_hidden` for vision) as in real CLIPs,
    so a projection applied to the wrong tower cannot go unnoticed."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, bos_id, eos_id = _write_tokenizer(path, max_position_embeddings)
    text_config = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "num_hidden_layers": text_layers,
        "num_attention_heads": num_heads,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": hidden_act,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
    }
    vision_config = {
        "hidden_size": vision_hidden,
        "intermediate_size": 4 * vision_hidden,
        "num_hidden_layers": vision_layers,
        "num_attention_heads": num_heads,
        "image_size": image_size,
        "patch_size": patch_size,
        "hidden_act": hidden_act,
    }
    config = transformers.CLIPConfig(
        text_config=text_config, vision_config=vision_config, projection_dim=projection_dim
    )
    model = transformers.CLIPModel(config)
    _randomise(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    _write_preprocessor(path, image_size)
    return path
