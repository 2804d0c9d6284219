"""Pooling models: what a folder says (worker_svc/model/pooling.py), and `LLM.embed` /
`LLM.encode` on the in-process engine against the references on the same weights —
sentence-transformers' `encode` for its folders (last-token, mean and CLS pooling, with and
without Normalize), transformers' `AutoModel` for a bare `Qwen3Model` — in fp32 (cosine
>= 0.99999, 1e-5 per component) and bf16 (a bound derived from transformers' own bf16
error), with prompts chunked across steps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagemesh import LLM, PoolingParams
from pagemesh.tools.testing.tiny_embedding import write_embedding_model
from pagemesh.tools.testing.tiny_models import write_realistic_model
from protos.step import PoolingInfo
from worker_svc.model.pooling import pooling_info

TEXTS = [
    "The capital of France is Paris.",
    "a",
    "naïve café " * 4,
    "the quick brown fox jumps over the lazy dog " * 9,
]


def llm(path: Path, **kwargs) -> LLM:
    # A 32-token step budget: the long texts are computed in several chunks.
    return LLM(str(path), max_num_batched_tokens=32, kv_cache_memory_gib=0.02, **kwargs)


def assert_close(ours, theirs, atol: float = 1e-5) -> None:
    ours, theirs = np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32)
    assert ours.shape == theirs.shape
    cosine = float(ours @ theirs / np.linalg.norm(ours) / np.linalg.norm(theirs))
    assert cosine >= 0.99999, cosine
    assert np.abs(ours - theirs).max() <= atol


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", False), ("cls", True)])
def test_embed_equals_sentence_transformers(tmp_path: Path, pooling: str, normalize: bool) -> None:
    from sentence_transformers import SentenceTransformer

    folder = write_embedding_model(
        tmp_path / "m", "qwen3", pooling=pooling, normalize=normalize, seed=2
    )
    expected = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)
    with llm(folder, dtype="float32") as engine:
        assert engine.info.pooling == PoolingInfo("embed", pooling, normalize, 64)
        outputs = engine.embed(TEXTS, use_tqdm=False)
        encoded = engine.encode(TEXTS[:1], use_tqdm=False)
    for output, vector in zip(outputs, expected, strict=True):
        assert_close(output.outputs.embedding, vector)
    assert isinstance(encoded[0].outputs.data, torch.Tensor)
    assert_close(encoded[0].outputs.data.numpy(), expected[0])
    assert outputs[1].prompt_token_ids[-1] == outputs[0].prompt_token_ids[-1]  # <|endoftext|>


def reference_vectors(folder: Path, texts: list[str], dtype: torch.dtype) -> np.ndarray:
    """transformers' `AutoModel` with the default pooling of a bare model: the last token's
    hidden state, normalised."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder, dtype=dtype).eval()
    vectors = []
    with torch.no_grad():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]
            vectors.append(torch.nn.functional.normalize(hidden.float(), dim=0).numpy())
    return np.stack(vectors)


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_embedding_model(
        tmp_path_factory.mktemp("bare") / "m", "qwen3", layout="bare", seed=5, is_matryoshka=True
    )


def test_a_bare_model_embeds_as_transformers_and_cuts_dimensions(bare_model: Path) -> None:
    expected = reference_vectors(bare_model, TEXTS, torch.float32)
    with llm(bare_model, dtype="float32") as engine:
        assert engine.info.architecture == "Qwen3Model"
        full = engine.embed(TEXTS, use_tqdm=False)
        cut = engine.embed(TEXTS, PoolingParams(dimensions=24), use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions 65 is not supported"):
            engine.embed(TEXTS, PoolingParams(dimensions=65), use_tqdm=False)
        with pytest.raises(ValueError, match="is empty"):
            engine.embed(["x", ""], use_tqdm=False)
        with pytest.raises(ValueError, match="generates text|embedding model"):
            engine.generate(["x"], use_tqdm=False)
    for output, short, vector in zip(full, cut, expected, strict=True):
        assert_close(output.outputs.embedding, vector)
        assert_close(short.outputs.embedding, vector[:24] / np.linalg.norm(vector[:24]))


def test_bf16_stays_within_transformers_own_bf16_error(bare_model: Path) -> None:
    """Bound: transformers in bf16 against fp32 sets the scale; ours in bf16 may be off by
    at most twice that (plus 1e-3 for rounding in another order)."""
    exact = reference_vectors(bare_model, TEXTS, torch.float32)
    theirs = reference_vectors(bare_model, TEXTS, torch.bfloat16)
    with llm(bare_model, dtype="bfloat16") as engine:
        ours = np.stack([o.outputs.embedding for o in engine.embed(TEXTS, use_tqdm=False)])
    their_error = np.abs(theirs - exact).max()
    assert np.abs(ours - exact).max() <= 2 * their_error + 1e-3
    cosines = (ours * exact).sum(1)  # both unit vectors
    assert cosines.min() >= min(((theirs * exact).sum(1)).min() - 1e-3, 0.999)


def test_a_generative_model_embeds_under_task_embed_only(tmp_path: Path) -> None:
    folder = write_realistic_model(tmp_path / "llama", "llama", seed=1)
    with llm(folder, dtype="float32") as engine:
        with pytest.raises(ValueError, match='task="embed"'):
            engine.embed(["hello"], use_tqdm=False)
    with llm(folder, dtype="float32", task="embed") as engine:
        assert engine.info.pooling.pooling_type == "last"
        vector = np.asarray(engine.embed(["hello"], use_tqdm=False)[0].outputs.embedding)
    assert vector.shape == (64,) and abs(np.linalg.norm(vector) - 1) < 1e-5


def write_config(folder: Path, **files) -> None:
    """JSON files under `folder`; `__` in a name is a folder separator."""
    for name, content in files.items():
        path = folder / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


def st_modules(*kinds: str) -> list[dict]:
    paths = {"Transformer": "", "Pooling": "1_Pooling"}
    return [
        {
            "idx": i,
            "name": str(i),
            "path": paths.get(kind, f"{i}_{kind}"),
            "type": f"sentence_transformers.models.{kind}",
        }
        for i, kind in enumerate(kinds)
    ]


def test_pooling_info_reads_the_folder(tmp_path: Path) -> None:
    arch = "Qwen3ForCausalLM"
    assert pooling_info(tmp_path, {}, arch, "auto", 64) == PoolingInfo()
    assert pooling_info(tmp_path, {}, "LlamaModel", "auto", 64) == PoolingInfo(
        "embed", "last", True, 64
    )
    write_config(
        tmp_path,
        **{
            "modules.json": st_modules("Transformer", "Pooling"),
            "1_Pooling__config.json": {"pooling_mode_mean_tokens": True},
        },
    )
    info = pooling_info(tmp_path, {"matryoshka_dimensions": [8, 32, 128]}, arch, "auto", 64)
    assert info == PoolingInfo("embed", "mean", False, 64, (8, 32))
    assert info.dimensions_error(32) is None and info.dimensions_error(64) is None
    assert "accepts: 8, 32" in info.dimensions_error(16)
    assert pooling_info(tmp_path, {}, arch, "generate", 64) == PoolingInfo()
    with pytest.raises(ValueError, match="--task embed"):
        pooling_info(tmp_path, {}, "Qwen3Model", "generate", 64)


@pytest.mark.parametrize(
    "modules, pooling, message",
    [
        (
            ("Transformer", "Pooling", "Dense", "Normalize"),
            {"pooling_mode_cls_token": True},
            "Dense",
        ),
        (("Transformer", "Pooling"), {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
        (
            ("Transformer", "Pooling"),
            {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True},
            "exactly one",
        ),
    ],
)
def test_pooling_it_cannot_compute_is_refused_by_name(
    tmp_path: Path, modules, pooling, message
) -> None:
    write_config(
        tmp_path, **{"modules.json": st_modules(*modules), "1_Pooling__config.json": pooling}
    )
    with pytest.raises(ValueError, match=message):
        pooling_info(tmp_path, {}, "Qwen3ForCausalLM", "auto", 64)


def test_clip_embeds_texts_and_images_offline(tmp_path: Path) -> None:
    """vLLM's prompt shapes: texts, and {"prompt", "multi_modal_data": {"image"}} with a PIL
    image or encoded bytes; the same vectors as the CLIP towers' own (normalised)."""
    import io

    from PIL import Image

    from pagemesh.runtime.images import ClipImageProcessor
    from pagemesh.tools.testing.tiny_clip import write_tiny_clip
    from worker_svc.model.clip import load_clip

    folder = write_tiny_clip(tmp_path / "clip", seed=1)
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (36, 44, 3), np.uint8))
    png = io.BytesIO()
    image.save(png, format="PNG")
    with LLM(str(folder), dtype="float32") as engine:
        assert engine.info.pooling.image_tokens == 17
        outputs = engine.embed(
            [
                "a cat",
                {"prompt": "", "multi_modal_data": {"image": image}},
                {"multi_modal_data": {"image": png.getvalue()}},
            ],
            use_tqdm=False,
        )
        with pytest.raises(ValueError, match="at most 77"):
            engine.embed(["cat " * 80], use_tqdm=False)
    towers = load_clip(folder)
    pixels = torch.from_numpy(ClipImageProcessor.from_folder(folder).preprocess([image]))
    with torch.no_grad():
        text = towers.text_embeddings([outputs[0].prompt_token_ids])[0]
        picture = towers.image_embeddings(pixels)[0]
    normalize = torch.nn.functional.normalize
    assert_close(outputs[0].outputs.embedding, normalize(text, dim=0).numpy())
    for output in outputs[1:]:
        assert_close(output.outputs.embedding, normalize(picture, dim=0).numpy())
