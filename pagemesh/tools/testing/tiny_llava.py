"""A tiny random LLaVA folder (`LlavaForConditionalGeneration`, or with `next=True`
`LlavaNextForConditionalGeneration`), for tests: transformers' own files, at trained scales.

`write_tiny_llava(path)` writes what a llava-hf checkpoint holds: config.json (LlavaConfig
with a CLIP vision config and a Llama-family text config), model.safetensors, a BPE
tokenizer with an added `<image>` special token and a chat template that renders a
message's image parts as `<image>`, preprocessor_config.json (CLIPImageProcessor at the
tower's image size) and processor_config.json (LlavaProcessor: patch_size, the feature
select strategy and `num_additional_image_tokens` 1 for CLIP's CLS, so that one `<image>`
expands to `image_seq_length` placeholders, as llava-hf's own files say) with
chat_template.jinja (the same template, for `processor.apply_chat_template`).

Tensor names (`naming`):
- "transformers5": as transformers 5.24's `save_pretrained` writes them. It saves in the
  legacy layout (it reverses its load-time renames), except that the vision tower has no
  `vision_model.`: `vision_tower.embeddings.*`, `vision_tower.encoder.layers.*`,
  `vision_tower.pre_layrnorm.*`, `vision_tower.post_layernorm.*`,
  `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`.
  (In memory transformers names them `model.vision_tower.embeddings.*`,
  `model.multi_modal_projector.*`, `model.language_model.layers.*`, `lm_head.weight`.)
- "llava-hf": the Hub's layout, as transformers 4 wrote it: `vision_tower.vision_model.*`,
  `multi_modal_projector.*`, `language_model.model.*`, `language_model.lm_head.weight`.

Weights: the vision tower as tiny_clip's (std 0.02 embeddings and biases, q/k at 0.2, the
other matrices at gain 1, norms around 1) so that different images give clearly different
features; the projector at gain 1 too (its output is what the decoder reads in place of
token embeddings); the decoder as tiny_models' realistic models (std 0.02, q/k 0.2, norms
1 + 0.2 noise).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from pagemesh.tools.testing.tiny_clip import _write_preprocessor
from pagemesh.tools.testing.tiny_models import (
    EOS_TOKEN,
    REALISTIC_ATTENTION_STD,
    REALISTIC_STD,
    train_tiny_tokenizer,
)

IMAGE_TOKEN = "<image>"
NAMINGS = ("transformers5", "llava-hf")
# Content parts: {"type": "image"} (or "image_url", OpenAI's) -> "<image>\n", {"type":
# "text", "text": ...} -> the text; a plain string content is rendered as is.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}" + IMAGE_TOKEN + "\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|endoftext|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
_TEXT_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}
# LLaVA-NeXT's grids for a 32-pixel tower: 1x2, 2x1, 2x2, 1x3 and 3x1 tiles.
NEXT_PINPOINTS = [[32, 64], [64, 32], [64, 64], [32, 96], [96, 32]]
_UNIT_GAIN_WEIGHTS = (
    "v_proj.weight",
    "out_proj.weight",
    "fc1.weight",
    "fc2.weight",
    "patch_embedding.weight",
    "linear_1.weight",
    "linear_2.weight",
)


def _write_tokenizer(path: Path) -> tuple[int, int]:
    """Writes the tokenizer files; returns (vocab_size, image_token_id)."""
    tokenizer = train_tiny_tokenizer(512)
    tokenizer.add_special_tokens([IMAGE_TOKEN])
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
    return tokenizer.get_vocab_size(), tokenizer.token_to_id(IMAGE_TOKEN)


def _write_processor_config(path: Path, patch_size: int, next: bool = False) -> None:
    config = {
        "processor_class": "LlavaNextProcessor" if next else "LlavaProcessor",
        "image_token": IMAGE_TOKEN,
        "patch_size": patch_size,
        "vision_feature_select_strategy": "default",
        # LlavaProcessor counts (H / patch) * (W / patch) + this, minus 1 for "default":
        # 1 (CLIP's CLS) makes it num_patches; its default 0 would give one too few.
        "num_additional_image_tokens": 1,
    }
    (path / "processor_config.json").write_text(json.dumps(config, indent=2))
    # The processor reads its own chat template from here, not from tokenizer_config.json.
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _randomise(model: torch.nn.Module, seed: int, text_std: float) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_text = "language_model" in name or name.startswith("lm_head")
            if "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + (0.2 if is_text else 0.1) * noise)
            elif ("q_proj" in name or "k_proj" in name) and name.endswith(".weight"):
                param.copy_(REALISTIC_ATTENTION_STD * noise)
            elif not is_text and name.endswith(_UNIT_GAIN_WEIGHTS):
                param.copy_(noise / math.sqrt(param[0].numel()))  # std 1 / sqrt(fan_in)
            else:
                param.copy_((text_std if is_text else REALISTIC_STD) * noise)


def llava_hf_name(name: str) -> str:
    """A tensor name as transformers 5 saves it, in the Hub's llava-hf layout: the vision
    tower's tensors get back the `vision_model.` that transformers 5 drops (its
    CLIPVisionModel has no such submodule, and saving does not put it back)."""
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name[len("vision_tower.") :]
    if (
        name.startswith(
            (
                "vision_tower.",
                "multi_modal_projector.",
                "language_model.model.",
                "language_model.lm_head.",
            )
        )
        or name == "image_newline"
    ):
        return name
    raise ValueError(f"unexpected LLaVA tensor name {name!r}")


def _rename_to_llava_hf(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    save_file({llava_hf_name(k): v for k, v in tensors.items()}, file, metadata={"format": "pt"})


def write_tiny_llava(
    path: str | Path,
    seed: int = 0,
    *,
    naming: str = "transformers5",
    image_size: int = 32,
    patch_size: int = 8,
    vision_layers: int = 2,
    text_arch: str = "llama",
    vision_hidden: int = 96,
    text_hidden: int = 64,
    text_std: float = REALISTIC_STD,
    next: bool = False,
    **text_overrides: Any,
) -> Path:
    """Write a tiny random LLaVA folder to `path`; deterministic given `seed` (both namings
        hold the same weights). The tower and decoder widths differ, so a projector wired the
        wrong way round cannot go unnoticed. `text_std`: the language model's weights' (a
        trained model's scale by default; tiny_models.PEAKY_STD for greedy tokens that never
        part at a near-tie). `next`: a LLaVA-NeXT, tiling images on `NEXT_PINPOINTS` (scaled to
    the tower's image size), with its image processor's and processor's configs."""
    import transformers

    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    if text_arch not in _TEXT_CONFIGS:
        raise ValueError(f"text_arch must be one of {sorted(_TEXT_CONFIGS)}, got {text_arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size, image_token_id = _write_tokenizer(path)
    vision_config = transformers.CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=4 * vision_hidden,
        num_hidden_layers=vision_layers,
        num_attention_heads=4,
        image_size=image_size,
        patch_size=patch_size,
        hidden_act="quick_gelu",
        projection_dim=32,
    )
    text_kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": text_hidden,
        "intermediate_size": 2 * text_hidden,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        **({"sliding_window": None} if text_arch == "mistral" else {}),
        **text_overrides,
    }
    text_config = getattr(transformers, _TEXT_CONFIGS[text_arch])(**text_kwargs)
    common = dict(
        vision_config=vision_config,
        text_config=text_config,
        image_token_index=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        image_seq_length=(image_size // patch_size) ** 2,
    )
    pinpoints = [[side * image_size // 32 for side in pair] for pair in NEXT_PINPOINTS]
    if next:
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=pinpoints)
        model = transformers.LlavaNextForConditionalGeneration(config)
    else:
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**common))
    _randomise(model, seed, text_std)
    model.save_pretrained(path, safe_serialization=True)
    if naming == "llava-hf":
        _rename_to_llava_hf(path)
    _write_preprocessor(path, image_size)
    if next:
        _make_next_preprocessor(path, pinpoints)
    _write_processor_config(path, patch_size, next)
    return path


def _make_next_preprocessor(path: Path, pinpoints: list[list[int]]) -> None:
    """CLIP's preprocessor config as LlavaNextImageProcessor's: the grids, padding on."""
    file = path / "preprocessor_config.json"
    config = json.loads(file.read_text())
    config.update(
        {
            "image_processor_type": "LlavaNextImageProcessor",
            "image_grid_pinpoints": pinpoints,
            "do_pad": True,
        }
    )
    file.write_text(json.dumps(config, indent=2))
