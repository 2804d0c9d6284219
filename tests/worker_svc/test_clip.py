"""worker_svc.model.clip against transformers' CLIPModel on a tiny random checkpoint.

Bounds:
- fp32: max abs diff <= 1e-4 and cosine >= 0.99999 against `get_text_features` /
  `get_image_features` (measured: text 1.5e-6, images 0.0, cosine 1.0 to 1e-7, on
  embeddings of magnitude up to ~3). Hidden states: 1e-5 (measured 0.0: the same ops in the
  same order).
- bf16: bf16 keeps 8 significant bits (relative rounding 2^-8 = 3.9e-3), so a bf16 run is
  judged by its distance to the fp32 reference, against the distance of transformers' own
  bf16 run to that reference: both round the same weights and run the same ops in bf16, so
  their errors are of one size, though not the same values (batching and the attention
  kernel change the order of sums). Ours may be at most 2x transformers' error, in max abs
  diff and in 1 - cosine. Measured (max abs, 1 - cosine) against fp32: text ours 0.043 /
  2.7e-4, transformers 0.047 / 3.0e-4; images both 0.040 / 1.7e-4 (ours equal to
  transformers' bf16 there; text 0.02 apart: our batch is padded, theirs run one by one).
"""

from __future__ import annotations

import dataclasses
import io
import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file

from pagemesh.runtime.images import ClipImageProcessor, load_image
from pagemesh.tools.testing.tiny_clip import write_tiny_clip
from worker_svc.model.clip import ClipConfig, is_clip_folder, load_clip

PROMPTS = [
    "a photo of a cat",
    "Paris is the capital of France, Berlin is the capital of Germany, and Rome is the "
    "capital of Italy.",
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "",  # only the start and end tokens
]
BF16_FACTOR = 2.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture(scope="module")
def hf_fp32(folder):
    return transformers.CLIPModel.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours_fp32(folder):
    return load_clip(folder, torch.float32)


@pytest.fixture(scope="module")
def token_ids(folder) -> list[list[int]]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return [tokenizer.encode(prompt).ids for prompt in PROMPTS]


def png_bytes(width: int, height: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


IMAGES = [  # (width, height, mode): square, non-square both ways, smaller than 32, alpha, gray
    (32, 32, "RGB"),
    (80, 50, "RGB"),
    (24, 90, "RGB"),
    (12, 20, "RGB"),
    (40, 40, "RGBA"),
    (45, 33, "L"),
]


@pytest.fixture(scope="module")
def image_data() -> list[bytes]:
    return [png_bytes(w, h, mode, seed) for seed, (w, h, mode) in enumerate(IMAGES)]


@pytest.fixture(scope="module")
def pixel_values(folder, image_data) -> torch.Tensor:
    """Ours end to end: bytes -> pagemesh.runtime.images -> ClipImageProcessor."""
    processor = ClipImageProcessor.from_folder(folder)
    return torch.from_numpy(processor.preprocess([load_image(d) for d in image_data]))


def hf_text(model, token_ids: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat(
            [model.get_text_features(torch.tensor([ids])).pooler_output for ids in token_ids]
        )


def hf_image(model, pixel_values: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        pixels = pixel_values.to(model.dtype)
        return model.get_image_features(pixel_values=pixels).pooler_output


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, atol: float, min_cos: float) -> None:
    ours, theirs = ours.float(), theirs.float()
    assert ours.shape == theirs.shape
    max_diff = (ours - theirs).abs().max().item()
    cosine = torch.cosine_similarity(ours, theirs, dim=-1).min().item()
    assert max_diff <= atol and cosine >= min_cos, (max_diff, cosine)


def errors(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs diff, 1 - min cosine) of `ours` against `reference`."""
    ours, reference = ours.float(), reference.float()
    cosine = torch.cosine_similarity(ours, reference, dim=-1).min().item()
    return (ours - reference).abs().max().item(), 1.0 - cosine


# Text --------------------------------------------------------------------------------------


def test_text_embeddings_match_transformers(folder, hf_fp32, ours_fp32, token_ids) -> None:
    assert len({len(ids) for ids in token_ids}) == len(token_ids)  # all lengths differ
    with torch.inference_mode():
        batched = ours_fp32.text_embeddings(token_ids)
        alone = torch.cat([ours_fp32.text_embeddings([ids]) for ids in token_ids])
    assert batched.shape == (len(PROMPTS), 32)
    assert_close(batched, hf_text(hf_fp32, token_ids), atol=1e-4, min_cos=0.99999)
    assert (batched - alone).abs().max().item() <= 1e-5  # measured 1.5e-6: batched sums
    # transformers' own tokenizer and padded batch agree with our ids and embeddings
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    inputs = tokenizer(PROMPTS, padding=True, return_tensors="pt")
    assert [
        ids[: len(mine)] for ids, mine in zip(inputs.input_ids.tolist(), token_ids)
    ] == token_ids
    with torch.inference_mode():
        padded = hf_fp32.get_text_features(**inputs).pooler_output
    assert_close(batched, padded, atol=1e-4, min_cos=0.99999)
    # non-degenerate: different texts, different directions
    cosines = torch.cosine_similarity(batched[:1], batched[1:], dim=-1)
    assert cosines.max().item() < 0.9


def test_text_pooling_positions_match_transformers(folder, hf_fp32, ours_fp32) -> None:
    eos = ours_fp32.config.text.eos_token_id
    crafted = [
        [eos - 1, 10, eos, eos, 20],  # first end-of-text, not the last
        [eos - 1, 10, 20],  # none: transformers pools position 0
        [3, 250, 17, 9],
    ]
    with torch.inference_mode():
        assert_close(
            ours_fp32.text_embeddings(crafted),
            hf_text(hf_fp32, crafted),
            atol=1e-4,
            min_cos=0.99999,
        )
    assert ours_fp32.text.pool_positions(crafted).tolist() == [2, 0, 0]
    # Legacy configs (eos_token_id 2) pool at the first largest id.
    config = ours_fp32.config
    legacy_config = dataclasses.replace(
        config, text=dataclasses.replace(config.text, eos_token_id=2)
    )
    legacy = load_clip(folder, config=legacy_config)
    assert legacy.text.pool_positions(crafted).tolist() == [2, 0, 1]
    hf_fp32.text_model.eos_token_id = 2
    try:
        theirs = hf_text(hf_fp32, crafted)
    finally:
        hf_fp32.text_model.eos_token_id = eos
    with torch.inference_mode():
        assert_close(legacy.text_embeddings(crafted), theirs, atol=1e-4, min_cos=0.99999)


def test_too_long_or_invalid_text_raises(ours_fp32) -> None:
    with pytest.raises(ValueError, match="78 tokens.*max_position_embeddings=77"):
        ours_fp32.text_embeddings([[1, 2], [5] * 78])
    with pytest.raises(ValueError, match="0 tokens"):
        ours_fp32.text_embeddings([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours_fp32.text_embeddings([[1, 10_000]])


# Images ------------------------------------------------------------------------------------


def test_image_embeddings_match_transformers(
    folder, hf_fp32, ours_fp32, image_data, pixel_values
) -> None:
    # transformers end to end: its processor on the decoded images, then its model
    hf_processor = transformers.CLIPImageProcessorPil.from_pretrained(folder)
    decoded = [Image.open(io.BytesIO(d)) for d in image_data]
    hf_pixels = hf_processor(decoded, return_tensors="pt")["pixel_values"]
    assert torch.equal(pixel_values, hf_pixels)
    with torch.inference_mode():
        ours = ours_fp32.image_embeddings(pixel_values)
    assert ours.shape == (len(IMAGES), 32)
    assert_close(ours, hf_image(hf_fp32, hf_pixels), atol=1e-4, min_cos=0.99999)
    cosines = torch.cosine_similarity(ours[:1], ours[1:], dim=-1)
    assert cosines.max().item() < 0.95  # different images, different directions


@pytest.mark.parametrize("layer", [-2, -1, 0, 1, -3])
def test_vision_hidden_states_match_transformers(
    hf_fp32, ours_fp32, pixel_values, layer: int
) -> None:
    with torch.inference_mode():
        theirs = hf_fp32.vision_model(
            pixel_values=pixel_values, output_hidden_states=True
        ).hidden_states
        ours = ours_fp32.vision.hidden_states(pixel_values, layer)
    assert len(theirs) == 3 and ours.shape == (len(IMAGES), 17, 96)
    assert (ours - theirs[layer]).abs().max().item() <= 1e-5


def test_vision_input_checks(ours_fp32) -> None:
    with pytest.raises(IndexError, match="layer 3 is out of range for 3"):
        ours_fp32.vision.hidden_states(torch.zeros(1, 3, 32, 32), 3)
    with pytest.raises(IndexError, match="layer -4"):
        ours_fp32.vision.hidden_states(torch.zeros(1, 3, 32, 32), -4)
    with pytest.raises(ValueError, match=r"\[N, 3, 32, 32\], got \[1, 3, 64, 64\]"):
        ours_fp32.image_embeddings(torch.zeros(1, 3, 64, 64))


# bf16 --------------------------------------------------------------------------------------


def test_bf16_error_is_transformers_bf16_error(folder, hf_fp32, token_ids, pixel_values) -> None:
    ours = load_clip(folder, torch.bfloat16)
    hf_bf16 = transformers.CLIPModel.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert ours.text.layers[0].mlp.fc1.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        ours_text, ours_images = (
            ours.text_embeddings(token_ids),
            ours.image_embeddings(pixel_values),
        )
    for name, mine, theirs, reference in [
        ("text", ours_text, hf_text(hf_bf16, token_ids), hf_text(hf_fp32, token_ids)),
        ("images", ours_images, hf_image(hf_bf16, pixel_values), hf_image(hf_fp32, pixel_values)),
    ]:
        assert mine.dtype == torch.bfloat16
        ours_abs, ours_cos = errors(mine, reference)
        hf_abs, hf_cos = errors(theirs, reference)
        assert ours_abs <= BF16_FACTOR * hf_abs, (name, ours_abs, hf_abs)
        assert ours_cos <= BF16_FACTOR * hf_cos, (name, ours_cos, hf_cos)
        # not vacuous: the error stays at bf16's ~1% of the embeddings' scale
        assert ours_abs < 0.05 * reference.abs().max().item(), (name, ours_abs)


# Other activations and configs -------------------------------------------------------------


def test_gelu_model_matches_transformers(tmp_path) -> None:
    folder = write_tiny_clip(tmp_path, seed=1, hidden_act="gelu", text_layers=1, vision_layers=1)
    hf = transformers.CLIPModel.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_clip(folder)
    ids = [[1, 5, 9, ours.config.text.eos_token_id], [7, ours.config.text.eos_token_id]]
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert_close(ours.text_embeddings(ids), hf_text(hf, ids), 1e-4, 0.99999)
        assert_close(ours.image_embeddings(pixels), hf_image(hf, pixels), 1e-4, 0.99999)


def test_config_defaults_are_transformers_defaults() -> None:
    config = ClipConfig.from_dict({})
    hf_text_config = transformers.CLIPTextConfig()
    hf_vision_config = transformers.CLIPVisionConfig()
    for part, hf_part in [(config.text, hf_text_config), (config.vision, hf_vision_config)]:
        for field in dataclasses.fields(part):
            assert getattr(part, field.name) == getattr(hf_part, field.name), field.name
    assert config.projection_dim == transformers.CLIPConfig().projection_dim
    # Older checkpoints' text_config_dict wins over text_config, as in transformers.
    overridden = ClipConfig.from_dict(
        {"text_config": {"hidden_size": 64}, "text_config_dict": {"hidden_size": 128}}
    )
    assert overridden.text.hidden_size == 128
    with pytest.raises(ValueError, match="hidden_act 'relu'"):
        ClipConfig.from_dict({"vision_config": {"hidden_act": "relu"}})


def test_is_clip_folder(folder, tmp_path) -> None:
    assert is_clip_folder(folder)
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    assert not is_clip_folder(tmp_path)
    assert not is_clip_folder(tmp_path / "missing")


# Loading -----------------------------------------------------------------------------------


def test_unplaced_checkpoint_tensor_raises(folder, tmp_path) -> None:
    shutil.copy(folder / "config.json", tmp_path)
    shutil.copy(folder / "model.safetensors", tmp_path)
    save_file(
        {"text_model.encoder.layers.0.extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors"
    )
    with pytest.raises(
        ValueError,
        match="'text_model.encoder.layers.0.extra.weight' "
        r"\(extra.safetensors\) has no place",
    ):
        load_clip(tmp_path)


def test_unfilled_parameter_and_wrong_shape_raise(folder, tmp_path) -> None:
    shutil.copy(folder / "config.json", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["vision_model.post_layernorm.bias"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        ValueError,
        match="1 parameters of the CLIP model .* have no tensor.*vision.post_layernorm.bias",
    ):
        load_clip(tmp_path)
    tensors["vision_model.post_layernorm.bias"] = torch.zeros(95)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="post_layernorm.bias' has shape \\[95\\]"):
        load_clip(tmp_path)


def test_vision_tower_only_under_a_prefix(folder, ours_fp32, pixel_values, tmp_path) -> None:
    """LLaVA's layout: the CLIP vision model under `vision_tower.`, no projection, and other
    tensors (the projector, the language model) that are not CLIP's."""
    tensors = load_file(folder / "model.safetensors")
    llava = {
        f"vision_tower.{name}": tensor
        for name, tensor in tensors.items()
        if name.startswith("vision_model.")
    }
    llava["multi_modal_projector.linear_1.weight"] = torch.zeros(4, 96)
    llava["language_model.model.embed_tokens.weight"] = torch.zeros(8, 4)
    save_file(llava, tmp_path / "model.safetensors")
    config = ClipConfig(text=None, vision=ours_fp32.config.vision, projection_dim=None)
    tower = load_clip(tmp_path, prefix="vision_tower.", config=config)
    assert tower.text is None and tower.logit_scale is None
    with torch.inference_mode():
        features = tower.vision.hidden_states(pixel_values, -2)
        expected = ours_fp32.vision.hidden_states(pixel_values, -2)
    assert torch.equal(features, expected)
    with pytest.raises(ValueError, match="without visual_projection"):
        tower.image_embeddings(pixel_values)
    with pytest.raises(ValueError, match="no text tower"):
        tower.text_embeddings([[1]])
    with pytest.raises(ValueError, match="'(language_model|multi_modal_projector)\\."):
        load_clip(tmp_path, config=config)  # no prefix: every tensor must be CLIP's
