"""worker_svc.model.llava against transformers' LlavaForConditionalGeneration on tiny
random checkpoints in both tensor namings (transformers 5.24's save_pretrained, and the
Hub's llava-hf layout with `vision_tower.vision_model.*`).

Bounds (fp32): image features max abs diff <= 1e-5 against `get_image_features` (measured
0.0: the same ops in the same order); decoder logits <= 1e-4 against transformers' on a
text-only prompt of 20 tokens (measured 4.8e-7 on logits of std 0.16; our fused q/k/v and
paged attention sum in another order). Multi-layer / "full" features: 1e-5.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors import safe_open

from pagemesh.runtime.images import ClipImageProcessor, load_image
from pagemesh.tools.testing.tiny_llava import CHAT_TEMPLATE, IMAGE_TOKEN, write_tiny_llava
from worker_svc.attention import AttentionMetadata, TorchAttentionBackend
from worker_svc.kv_cache import KVCacheSpec, allocate_kv_caches
from worker_svc.model.config import parse_hf_config
from worker_svc.model.llama import LlamaForCausalLM
from worker_svc.model.llava import (
    LlavaConfig,
    is_llava_config,
    llava_checkpoint_name,
    load_llava_encoder,
)

NAMINGS = ("transformers5", "llava-hf")
IMAGES = [(32, 32, "RGB"), (80, 50, "RGB"), (24, 90, "RGB"), (40, 40, "RGBA")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny_llava")
    return {naming: write_tiny_llava(root / naming, naming=naming) for naming in NAMINGS}


@pytest.fixture(scope="module")
def hf_model(folders):
    return transformers.LlavaForConditionalGeneration.from_pretrained(
        folders["llava-hf"], dtype=torch.float32
    ).eval()


def png_bytes(width: int, height: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    image = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images() -> list[Image.Image]:
    return [load_image(png_bytes(w, h, mode, seed)) for seed, (w, h, mode) in enumerate(IMAGES)]


def tensor_names(folder) -> list[str]:
    with safe_open(folder / "model.safetensors", framework="pt") as tensors:
        return sorted(tensors.keys())


def test_both_namings_load_in_transformers_to_the_same_weights(folders, hf_model) -> None:
    assert any(
        n.startswith("vision_tower.embeddings.") for n in tensor_names(folders["transformers5"])
    )
    assert any(
        n.startswith("vision_tower.vision_model.") for n in tensor_names(folders["llava-hf"])
    )
    other = transformers.LlavaForConditionalGeneration.from_pretrained(
        folders["transformers5"], dtype=torch.float32
    ).state_dict()
    ours = hf_model.state_dict()
    assert ours.keys() == other.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, other[name]), name


def test_config(folders) -> None:
    import json

    raw = json.loads((folders["llava-hf"] / "config.json").read_text())
    assert is_llava_config(raw) and not is_llava_config(raw["text_config"])
    config = LlavaConfig.from_folder(folders["llava-hf"])
    assert config.image_seq_length == 16 == raw["image_seq_length"]
    assert config.text["model_type"] == "llama"
    assert config.image_token_index == raw["image_token_index"]
    full = LlavaConfig.from_dict({**raw, "vision_feature_select_strategy": "full"})
    assert full.image_seq_length == 17
    with pytest.raises(ValueError, match="out of range"):
        LlavaConfig.from_dict({**raw, "vision_feature_layer": 3})
    with pytest.raises(ValueError, match="only CLIP"):
        LlavaConfig.from_dict({**raw, "vision_config": {"model_type": "siglip_vision_model"}})


def test_checkpoint_names_map_both_namings_alike(folders) -> None:
    t5, hub = (tensor_names(folders[n]) for n in NAMINGS)
    assert len(t5) == len(hub)
    mapped_t5 = sorted(llava_checkpoint_name(n) for n in t5)
    assert mapped_t5 == sorted(llava_checkpoint_name(n) for n in hub)
    assert len(set(mapped_t5)) == len(mapped_t5)
    # transformers 5's in-memory names map alike too
    hf_names = (
        transformers.LlavaForConditionalGeneration.from_pretrained(folders["transformers5"])
        .state_dict()
        .keys()
    )
    assert sorted(llava_checkpoint_name(n) for n in hf_names) == mapped_t5
    assert llava_checkpoint_name("vision_tower.embeddings.class_embedding") == (
        "vision",
        "vision_tower.class_embedding",
    )
    assert llava_checkpoint_name("multi_modal_projector.linear_1.bias") == (
        "projector",
        "multi_modal_projector.linear_1.bias",
    )
    assert llava_checkpoint_name("language_model.lm_head.weight") == ("text", "lm_head.weight")
    assert llava_checkpoint_name("language_model.model.norm.weight") == (
        "text",
        "model.norm.weight",
    )
    assert llava_checkpoint_name("vision_tower.vision_model.encoder.layers.1.mlp.fc1.weight") == (
        "vision",
        "vision_tower.layers.1.mlp.fc1.weight",
    )
    assert llava_checkpoint_name("vision_tower.vision_model.embeddings.position_ids")[0] == "unused"
    # LLaVA-NeXT's row separator, in either naming.
    assert llava_checkpoint_name("image_newline") == ("projector", "image_newline")
    assert llava_checkpoint_name("model.image_newline") == ("projector", "image_newline")
    with pytest.raises(ValueError, match="no part"):
        llava_checkpoint_name("vision_resampler.weight")


@pytest.mark.parametrize("naming", NAMINGS)
def test_image_features_match_transformers(folders, hf_model, images, naming) -> None:
    folder = folders[naming]
    pixel_values = torch.from_numpy(ClipImageProcessor.from_folder(folder).preprocess(images))
    processor = transformers.AutoProcessor.from_pretrained(folder)
    theirs_pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixel_values, theirs_pixels)
    encoder = load_llava_encoder(folder, torch.float32)
    with torch.inference_mode():
        ours = encoder(pixel_values)
        theirs = hf_model.get_image_features(pixel_values=pixel_values).pooler_output
    assert isinstance(theirs, list) and len(theirs) == len(images)  # one [16, 64] per image
    theirs = torch.stack(theirs)
    assert ours.shape == (len(images), 16, 64) == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-5
    # Not degenerate: different images give clearly different features.
    flat = ours.flatten(1)
    cosine = torch.nn.functional.cosine_similarity(flat[:, None], flat[None], dim=-1)
    assert cosine[~torch.eye(len(images), dtype=torch.bool)].max() < 0.9


def test_multi_layer_and_full_strategy_match_transformers(folders, images) -> None:
    """A list of feature layers (concatenated) and "full" (CLS kept), on the same weights
    with a projector widened to take them."""
    config = transformers.LlavaConfig.from_pretrained(folders["llava-hf"])
    config.vision_feature_layer = [0, -1]
    config.vision_feature_select_strategy = "full"
    hf = transformers.LlavaForConditionalGeneration(config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0.0, 0.2)
    folder = folders["llava-hf"].parent / "multi_layer"
    hf.save_pretrained(folder, safe_serialization=True)
    encoder = load_llava_encoder(folder, torch.float32)
    pixel_values = torch.from_numpy(
        ClipImageProcessor.from_folder(folders["llava-hf"]).preprocess(images)
    )
    with torch.inference_mode():
        ours = encoder(pixel_values)
        theirs = torch.stack(hf.get_image_features(pixel_values=pixel_values).pooler_output)
    assert ours.shape == (len(images), 17, 64)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_missing_and_unplaced_tensors_are_named(folders, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(folders["llava-hf"] / "model.safetensors")
    for name, edit in [
        ("multi_modal_projector.linear_2.bias", "drop"),
        ("vision_tower.vision_model.encoder.layers.9.mlp.fc1.weight", "add"),
    ]:
        folder = tmp_path / edit
        shutil.copytree(folders["llava-hf"], folder)
        edited = dict(tensors)
        if edit == "drop":
            del edited[name]
        else:
            edited[name] = torch.zeros(1)
        save_file(edited, folder / "model.safetensors")
        expected = "linear_2.bias" if edit == "drop" else "layers.9.mlp.fc1.weight"
        with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
            load_llava_encoder(folder)


def test_decoder_logits_match_transformers_language_model(folders, hf_model) -> None:
    folder = folders["transformers5"]
    config = LlavaConfig.from_folder(folder)
    model_config = parse_hf_config(config.text)
    model = LlamaForCausalLM(model_config)
    with safe_open(folder / "model.safetensors", framework="pt") as tensors:
        text = [
            (llava_checkpoint_name(k)[1], tensors.get_tensor(k))
            for k in tensors.keys()
            if llava_checkpoint_name(k)[0] == "text"
        ]
    model.load_weights(text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("The quick brown fox jumps over the lazy dog.")["input_ids"]
    num_tokens, block_size = len(ids), 16
    num_blocks = -(-num_tokens // block_size)
    spec = KVCacheSpec(
        model_config.num_layers,
        block_size,
        model.num_local_kv_heads,
        model_config.head_dim,
        torch.float32,
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
    )
    with torch.inference_mode():
        hidden, residual = model(
            torch.tensor(ids),
            torch.arange(num_tokens),
            allocate_kv_caches(spec, num_blocks, "cpu"),
            metadata,
            TorchAttentionBackend(),
        )
        ours = model.compute_logits(hidden, residual)
        theirs = hf_model(input_ids=torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_processor_expands_image_token(folders, images) -> None:
    folder = folders["llava-hf"]
    processor = transformers.AutoProcessor.from_pretrained(folder)
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    ]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == "<|user|>\n<image>\nWhat is this?<|endoftext|>\n<|assistant|>\n"
    assert processor.tokenizer.chat_template == CHAT_TEMPLATE
    inputs = processor(text=[prompt], images=images[:1], return_tensors="pt")
    image_token_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert image_token_id == LlavaConfig.from_folder(folder).image_token_index
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(image_token_id) == 16
    start = ids.index(image_token_id)
    assert ids[start : start + 16] == [image_token_id] * 16  # one contiguous run
    unexpanded = processor.tokenizer(prompt)["input_ids"]
    assert unexpanded.count(image_token_id) == 1 and len(ids) == len(unexpanded) + 15
