"""A LLaVA through the in-process engine (`LLM.generate` with vLLM's `multi_modal_data`),
against transformers' LlavaForConditionalGeneration on the same folder: greedy tokens and
their logprobs (fp32, 1e-4) for one image and for two in one prompt, batched with a text-only
prompt, with a 20-token step budget so that chunked prefill cuts through the images (16
placeholders each, after ~8 tokens of text); the answer depends on the image; the same image
in several prompts is encoded once (the encoder cache)."""

from __future__ import annotations

import io
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
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llava(
        tmp_path_factory.mktemp("llava") / "tiny-llava", seed=3, naming="llava-hf"
    )


def image(seed: int, size: tuple[int, int] = (40, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def reference(folder: Path, text: str, images: list[Image.Image]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (full recompute each token)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    ids = inputs["input_ids"]
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = model(input_ids=ids, pixel_values=inputs.get("pixel_values")).logits[0, -1]
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            token = int(log_probs.argmax())
            tokens.append(token)
            logprobs.append(float(log_probs[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, logprobs


def test_image_prompts_equal_transformers_batched_and_chunked(folder: Path) -> None:
    cat, dog = image(1), image(2, (56, 36))
    requests = [
        {"prompt": PROMPT, "multi_modal_data": {"image": cat}},
        {"prompt": PROMPT, "multi_modal_data": {"image": png(dog)}},
        {"prompt": TWO, "multi_modal_data": {"image": [cat, dog]}},
        TEXT,
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=20) as engine:
        outputs = engine.generate(requests, params, use_tqdm=False)
        assert engine.info.image_seq_length == 16
        with pytest.raises(ValueError, match="1 image token"):
            engine.generate(
                {"prompt": PROMPT, "multi_modal_data": {"image": [cat, dog]}},
                params,
                use_tqdm=False,
            )
    expected = [
        reference(folder, PROMPT, [cat]),
        reference(folder, PROMPT, [dog]),
        reference(folder, TWO, [cat, dog]),
        reference(folder, TEXT, []),
    ]
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        ours = [lp[token].logprob for lp, token in zip(sample.logprobs, tokens)]
        np.testing.assert_allclose(ours, logprobs, atol=1e-4)
    # The answer depends on the image: another image, other tokens or other logprobs.
    cat_answer, dog_answer = outputs[0].outputs[0], outputs[1].outputs[0]
    assert cat_answer.token_ids != dog_answer.token_ids or not np.allclose(
        [lp[t].logprob for lp, t in zip(cat_answer.logprobs, cat_answer.token_ids)],
        [lp[t].logprob for lp, t in zip(dog_answer.logprobs, dog_answer.token_ids)],
        atol=1e-3,
    )


def test_llm_chat_takes_image_url_parts(folder: Path) -> None:
    import base64

    cat = image(1)
    url = "data:image/png;base64," + base64.b64encode(png(cat)).decode()
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": "What is in this picture?"},
            ],
        }
    ]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(folder), dtype="float32") as engine:
        answer = engine.chat(chat, params, use_tqdm=False)[0]
    assert answer.outputs[0].token_ids == reference(folder, PROMPT, [cat])[0]


def test_the_encoder_cache_encodes_an_image_once(folder: Path) -> None:
    from protos.step import ImageInput
    from worker_svc.batch import ImageSegment
    from worker_svc.loader import load_model
    from worker_svc.multimodal import llava_image_embedder

    _, metadata = load_model(folder, dtype="float32")
    embedder = llava_image_embedder(metadata, "cpu")
    cat, dog = png(image(1)), png(image(2))
    first = ImageSegment(ImageInput(cat, 8, 16), start_row=8, first=0, count=12)
    rest = ImageSegment(ImageInput(cat, 8, 16), start_row=0, first=12, count=4)
    rows, part1 = embedder.overrides([first], torch.device("cpu"))
    assert rows.tolist() == list(range(8, 20))
    _, part2 = embedder.overrides(
        [rest, ImageSegment(ImageInput(dog, 0, 16), 4, 0, 16)], torch.device("cpu")
    )
    assert embedder.num_encoded == 2 and embedder.num_cache_hits == 1
    whole = torch.cat([part1, part2[:4]])
    assert whole.shape == (16, 64)
    assert not torch.equal(part2[4:], whole)  # the dog's rows are not the cat's


def test_a_text_only_model_refuses_images(tmp_path: Path) -> None:
    from pagemesh.tools.testing.tiny_models import write_tiny_model

    with LLM(str(write_tiny_model(tmp_path / "llama", "llama")), dtype="float32") as engine:
        with pytest.raises(ValueError, match="text-only model"):
            engine.generate(
                {"prompt": "hi", "multi_modal_data": {"image": image(1)}}, use_tqdm=False
            )


@pytest.mark.parametrize("tp", [1, 2])
def test_image_prompts_equal_transformers_under_preemption(folder: Path, tp: int) -> None:
    """A KV cache of 6 blocks (96 tokens) for four image prompts of ~40 tokens and their
    outputs: requests are preempted (recomputed, their images encoded again or found in the
    encoder cache) and still give transformers' tokens; with tp=2 the decoder is sharded over
    two worker processes and the tower is replicated on both."""
    pictures = [image(10 + i, (30 + 7 * i, 50 - 5 * i)) for i in range(4)]
    requests = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    block_bytes = 3 * 2 * 2 * 16 * 16 * 4 // tp  # layers x (K, V) x KV heads x dim x tokens
    with LLM(
        str(folder),
        dtype="float32",
        tensor_parallel_size=tp,
        swap_space=0,
        kv_cache_memory_bytes=6 * block_bytes,
        max_num_batched_tokens=32,
        enable_prefix_caching=False,
    ) as engine:
        outputs = engine.generate(requests, params, use_tqdm=False)
        scheduler = engine._live_engine().engine_loop.scheduler
        assert scheduler.num_preemptions > 0, "the cache was meant to run out"
    for output, picture in zip(outputs, pictures, strict=True):
        tokens, logprobs = reference(folder, PROMPT, [picture])
        sample = output.outputs[0]
        assert sample.token_ids == tokens
        np.testing.assert_allclose(
            [lp[t].logprob for lp, t in zip(sample.logprobs, tokens)], logprobs, atol=1e-4
        )
