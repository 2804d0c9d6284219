"""LLaVA-NeXT ("anyres" tiling) in the in-process engine, against transformers'
LlavaNextForConditionalGeneration on the same folder (both checkpoint namings): an image's
placeholder count (the prompt transformers' LlavaNextProcessor expands), its features (the
tiles through the tower, laid out per image with image_newline), and greedy tokens with
logprobs (fp32, 1e-4) for images of several sizes and aspect ratios, two in one prompt,
batched with text, with a 24-token step budget cutting through the images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pagemesh import LLM, SamplingParams
from pagemesh.tools.testing.tiny_llava import write_tiny_llava

PROMPT = "<|user|>\n<image>\nWhat is in this picture?<|endoftext|>\n<|assistant|>\n"
TWO = "<|user|>\n<image>\nand\n<image>\nWhich differs?<|endoftext|>\n<|assistant|>\n"
TEXT = "<|user|>\nTell me a story.<|endoftext|>\n<|assistant|>\n"
MAX_TOKENS = 6
# (height, width): square, wide, tall, tiny, larger than every grid.
SIZES = [(40, 40), (30, 90), (100, 35), (5, 7), (150, 120)]


@pytest.fixture(scope="module", params=["llava-hf", "transformers5"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(
        tmp_path_factory.mktemp("next") / f"tiny-next-{request.param}",
        seed=4,
        naming=request.param,
        next=True,
    )


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def transformers_model(folder: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    return processor, model.eval()


def test_features_equal_transformers_for_every_size(folder: Path) -> None:
    from pagemesh.runtime.images_anyres import AnyResImageProcessor, num_feature_rows
    from worker_svc.model.llava import load_llava_encoder

    processor, model = transformers_model(folder)
    ours = AnyResImageProcessor.from_folder(folder)
    encoder = load_llava_encoder(folder)
    for seed, size in enumerate(SIZES):
        picture = image(seed, size)
        inputs = processor(text=PROMPT, images=[picture], return_tensors="pt")
        with torch.no_grad():
            expected = model.model.get_image_features(
                pixel_values=inputs["pixel_values"],
                image_sizes=inputs["image_sizes"],
                vision_feature_layer=-2,
                vision_feature_select_strategy="default",
            ).pooler_output[0]
            tiles, hw = ours.preprocess(picture)
            got = encoder.pack_anyres(encoder(torch.from_numpy(tiles)), hw)
        assert got.shape == expected.shape, size
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        placeholders = int((inputs["input_ids"] == model.config.image_token_index).sum())
        assert (
            placeholders
            == got.shape[0]
            == num_feature_rows(
                size[0], size[1], grid_pinpoints=ours.grid_pinpoints, tile_size=32, patch_size=8
            )
        )


def reference(
    processor, model, text: str, images: list[Image.Image]
) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    ids, tokens, logprobs = inputs["input_ids"], [], []
    extra = (
        {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
        if images
        else {}
    )
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, **extra).logits[0, -1]
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            tokens.append(int(log_probs.argmax()))
            logprobs.append(float(log_probs[tokens[-1]]))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logprobs


def test_generation_equals_transformers_batched_and_chunked(folder: Path) -> None:
    wide, tall, small = image(1, (30, 90)), image(2, (100, 35)), image(3, (20, 20))
    requests = [
        {"prompt": PROMPT, "multi_modal_data": {"image": wide}},
        {"prompt": PROMPT, "multi_modal_data": {"image": tall}},
        {"prompt": TWO, "multi_modal_data": {"image": [small, wide]}},
        TEXT,
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=24) as engine:
        outputs = engine.generate(requests, params, use_tqdm=False)
        assert engine.info.image_tiling.tile_size == 32
    processor, model = transformers_model(folder)
    expected = [
        reference(processor, model, PROMPT, [wide]),
        reference(processor, model, PROMPT, [tall]),
        reference(processor, model, TWO, [small, wide]),
        reference(processor, model, TEXT, []),
    ]
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        ours = [lp[token].logprob for lp, token in zip(sample.logprobs, tokens)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-4)
    assert outputs[0].prompt_token_ids != outputs[1].prompt_token_ids  # sizes differ
