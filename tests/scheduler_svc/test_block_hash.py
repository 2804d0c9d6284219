"""Block hashes: stable across processes, chained with the parent, full blocks only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from protos.block_hash import hash_block_tokens, hash_request_blocks
from tests.support.paths import REPO_ROOT


def test_hashes_are_the_same_in_another_process() -> None:
    tokens = [5, 17, 2**40, -3, 0, 151_000, 9, 9, 1]
    here = [h.hex() for h in hash_request_blocks(tokens, 4)]
    code = (
        "from protos.block_hash import hash_request_blocks;"
        f"print(' '.join(h.hex() for h in hash_request_blocks({tokens!r}, 4)))"
    )
    # A different hash seed would change Python's hash(); it must not change ours.
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    there = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert here == there and len(here) == 2


def test_known_value_pins_the_encoding() -> None:
    # Router and scheduler of different builds must agree: a change here is a format change.
    assert hash_block_tokens(None, [1, 2, 3, 4]).hex() == "508da14abd0760c905115f1f29b84de1"
    assert hash_block_tokens(None, (1, 2, 3, 4)) == hash_block_tokens(None, [1, 2, 3, 4])
    second = hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)[1]
    assert second.hex() == "2f7294b7ad7db01abb60f4b9123babc7"


def test_chaining_same_tokens_after_another_parent_differ() -> None:
    first_a = hash_block_tokens(None, [1, 2])
    first_b = hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(first_a, [9, 9]) != hash_block_tokens(first_b, [9, 9])
    assert hash_block_tokens(None, [9, 9]) != hash_block_tokens(first_a, [9, 9])
    assert hash_request_blocks([1, 2, 9, 9], 2)[1] == hash_block_tokens(first_a, [9, 9])


def test_extra_bytes_and_token_boundaries_change_the_hash() -> None:
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], extra=b"lora-1")
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, [256]) != hash_block_tokens(None, [1, 0])


def test_only_full_blocks_are_hashed() -> None:
    assert hash_request_blocks([1, 2, 3], 4) == []
    assert len(hash_request_blocks([1, 2, 3, 4], 4)) == 1
    assert len(hash_request_blocks(list(range(11)), 4)) == 2
    assert hash_request_blocks(list(range(11)), 4) == hash_request_blocks(list(range(8)), 4)
    with pytest.raises(ValueError):
        hash_request_blocks([1], 0)
