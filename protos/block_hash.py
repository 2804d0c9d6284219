"""KV block hashes shared by the router and the scheduler (stdlib only, no generated code).

A block hash names the KV of one full block of `block_size` tokens *and everything before
it*: each hash is chained with its parent's, so the same tokens after a different prefix
hash differently. The hash is blake2b (16 bytes) over a fixed little-endian encoding with
a fixed personalisation and root seed, so it is the same in every process and on every
machine (never Python's `hash()`, which is salted per process). Router and scheduler must
call these functions, never re-implement them, so that their hashes agree.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType, Protocol

# 16 bytes of blake2b; compared by value, used as a dict key.
BlockHash = NewType("BlockHash", bytes)

# Bump the version tag to invalidate every hash (e.g. if the encoding below changes).
_PERSON = b"pagemesh-kv-v1"
# The parent of a sequence's first block.
_ROOT_HASH = BlockHash(
    hashlib.blake2b(b"pagemesh block hash root", digest_size=16, person=_PERSON).digest()
)
_HEADER = struct.Struct("<QQ")  # number of tokens, length of `extra`


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra: bytes = b""
) -> BlockHash:
    """The hash of one block: its parent's hash (None for the first block), its token ids
    (each a signed 64-bit integer) and `extra` bytes that also change the KV (e.g. an
    adapter id; empty for plain text)."""
    digest = hashlib.blake2b(digest_size=16, person=_PERSON)
    digest.update(_ROOT_HASH if parent_hash is None else parent_hash)
    digest.update(_HEADER.pack(len(token_ids), len(extra)))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    digest.update(extra)
    return BlockHash(digest.digest())


def adapter_extra(name: str) -> bytes:
    """A LoRA adapter's part of every block hash of its requests (two adapters, or an
    adapter and the base model, never share KV; the same adapter does)."""
    return b"lora\x00" + name.encode() + b"\x00"


class PlacedImage(Protocol):
    """An image over prompt positions offset .. offset + length - 1 (protos.step.ImageInput)."""

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def digest(self) -> bytes: ...


def block_images(images: Sequence[PlacedImage], start: int, end: int) -> bytes:
    """The content hashes of the images whose placeholders fall in positions start..end-1
    (b"" for none): a block's `extra`, so that two prompts whose placeholder tokens are the
    same but whose images differ never share a block's KV."""
    return b"".join(
        image.digest
        for image in images
        if image.offset < end and image.offset + image.length > start
    )


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    images: Sequence[PlacedImage] = (),
) -> list[BlockHash]:
    """The chained hashes of the full blocks of `token_ids`; a last partial block has none.
    A vision-language prompt's images are hashed into the blocks they fall in."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        end = start + block_size
        block_extra = extra + block_images(images, start, end) if images else extra
        parent = hash_block_tokens(parent, token_ids[start:end], block_extra)
        hashes.append(parent)
    return hashes
