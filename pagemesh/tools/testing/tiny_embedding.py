"""Tiny embedding models at a trained checkpoint's scale, as the Hub ships them: a decoder
(`write_realistic_model`) saved as a sentence-transformers folder (modules.json, its Pooling
config, Normalize) or as a bare `*Model` without an LM head, with a tokenizer that appends
`<|endoftext|>` (as Qwen3-Embedding's does; its last-token pooling reads that token)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagemesh.tools.testing.tiny_models import EOS_TOKEN, write_realistic_model

_ST_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def write_embedding_model(
    path: str | Path,
    arch: str = "qwen3",
    *,
    pooling: str = "last",
    normalize: bool = True,
    layout: str = "sentence-transformers",
    seed: int = 0,
    **config: Any,
) -> Path:
    """`layout`: "sentence-transformers" (modules.json + 1_Pooling, weights without the
    `model.` prefix, as Qwen3-Embedding) or "bare" (architectures `<Arch>Model`, no LM head;
    pooling is then the default: last token, normalised). `config`: config.json additions,
    e.g. matryoshka_dimensions=[16, 32] or is_matryoshka=True."""
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, processors

    path = write_realistic_model(path, arch, seed)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )
    tokenizer.save(str(path / "tokenizer.json"))
    hf_config = json.loads((path / "config.json").read_text())
    hf_config.update(config)
    weights = load_file(str(path / "model.safetensors"))
    weights = {
        name.removeprefix("model."): tensor
        for name, tensor in weights.items()
        if not name.startswith("lm_head.")
    }
    if layout == "bare":
        hf_config["architectures"] = [hf_config["architectures"][0].replace("ForCausalLM", "Model")]
    elif layout == "sentence-transformers":
        _write_st_modules(path, pooling, normalize, hf_config["hidden_size"])
    else:
        raise ValueError(f"layout must be sentence-transformers or bare, not {layout!r}")
    hf_config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(hf_config, indent=2))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _write_st_modules(path: Path, pooling: str, normalize: bool, hidden_size: int) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {
        "word_embedding_dimension": hidden_size,
        "include_prompt": True,
        **{key: kind == pooling for kind, key in _ST_MODES.items()},
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    (path / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 512, "do_lower_case": False})
    )
