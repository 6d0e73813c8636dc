"""A disk-tier block's name: a hash chained over everything its keys and values depend on.

The chain starts at the store's seed (the format version and the store's fingerprint: checkpoint,
quantization, vision encoder, KV layout), keyed with a request's cache namespace when it has one;
each block's key hashes the key before it, its span, its tokens, their M-RoPE positions and the
picture behind each image or video that starts in it. A block's file is named by the key before it,
then its own: the blocks that continue one prefix sit side by side. Hashing only: nothing here
touches the disk.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from ...model.prompts import VisionSpan

BLOCK_TOKENS = 64  # 7 MiB of bf16 keys and values on Qwen3-VL-2B: a few files per picture
FORMAT_VERSION = 2  # seeds every name: files of another version are never found


@dataclass(frozen=True)
class Block:
    """Tokens [start, end) of a sequence, from the file at `path` (which may hold more: up to `stored`),
    the block after the chain key `previous`."""

    path: Path
    start: int
    end: int
    previous: bytes
    stored: int | None = None


def chain(
    previous: bytes, token_ids: torch.Tensor, positions: torch.Tensor, start: int, end: int, images: list[VisionSpan]
) -> bytes:
    """The key of tokens [start, end) after the chain key `previous`."""
    digest = hashlib.blake2b(previous, digest_size=16)
    digest.update(struct.pack("<qq", start, end))
    digest.update(token_ids[start:end].to(torch.int64).numpy().tobytes())
    digest.update(positions[:, start:end].to(torch.int64).contiguous().numpy().tobytes())
    for span in images:
        if start <= span.start < end:
            digest.update(f"{span.start}-{span.end}:{span.key};".encode())
    return digest.digest()


class BlockNames:
    """The chain keys and file names of one store: its folder `root` and its `fingerprint`."""

    def __init__(self, root: Path, fingerprint: str):
        self.root = Path(root)
        self.seed = hashlib.blake2b(f"{FORMAT_VERSION}:{fingerprint}".encode(), digest_size=16).digest()

    def seed_of(self, namespace: str) -> bytes:
        """The chain's first key: the store's seed, keyed with a request's cache namespace if it has one
        ("" keeps the store's own: the files of before namespaces)."""
        if not namespace:
            return self.seed
        return hashlib.blake2b(namespace.encode(), digest_size=16, key=self.seed).digest()

    def path(self, previous: bytes, key: bytes) -> Path:
        """A block's file: named by the chain before it, then its own key (the blocks that continue one
        prefix sit side by side, found by that first half)."""
        return self.root / previous.hex()[:2] / f"{previous.hex()}-{key.hex()}.kv"

    def full_blocks(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        length: int,
        namespace: str = "",
    ):
        """(Block, its own chain key) of each full block within `length` tokens, in order, in `namespace`'s chain."""
        previous = self.seed_of(namespace)
        for start in range(0, length - BLOCK_TOKENS + 1, BLOCK_TOKENS):
            key = chain(previous, token_ids, positions, start, start + BLOCK_TOKENS, images)
            yield Block(self.path(previous, key), start, start + BLOCK_TOKENS, previous), key
            previous = key
