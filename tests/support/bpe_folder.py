"""A small byte-level BPE tokenizer saved the Hugging Face way, for router tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

CORPUS = ["Hello world, the quick brown fox. 你好世界 😀🎉👍🏽 café naïve"] * 20


def write_bpe_folder(folder: Path, chat_template: str | None = None, add_bos: bool = False) -> Path:
    """~300 ids, so most CJK/emoji characters span several tokens; `<s>` in front if add_bos."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(CORPUS, trainer)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if add_bos:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
        config["bos_token"] = "<s>"
    if chat_template is not None:
        config["chat_template"] = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
