"""A disk-tier block's file, and the checks a read makes before it uses one.

A file is MAGIC and the header's length, the header (JSON), the payload, then a CRC-32 of header and
payload. The header says everything the file's name stands for — format version, the store's
fingerprint and KV layout, the chain key before it, its start, tokens, their M-RoPE positions, its
pictures and clips — so a read compares it with what the request needs; the payload is the keys and
values as `KVLayout` lays them out. A file that fails a check raises `Rejected`, saying why.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass

import torch

from ...memory import kv_shape
from ...model.prompts import VisionSpan
from .names import FORMAT_VERSION, Block

MAGIC = b"QVLKV\0\0\2"
_HEAD = struct.Struct("<8sI")  # magic, header length
_TRAILER = struct.Struct("<I")  # CRC-32 of header and payload


@dataclass(frozen=True)
class KVLayout:
    """How keys and values lie in a block's payload: per layer, keys then values, each
    kv_heads × tokens × head_dim values of `dtype` — the model's attention layers, then (`head`) its
    multi-token prediction head's, whose entry for a token's position lies at the next token's index
    (it depends on that token: service/model/mtp.py's `DraftCache.stored`)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    head: int = 0

    @classmethod
    def of(cls, config, dtype: torch.dtype, head: int = 0) -> KVLayout:
        return cls(*kv_shape(config), dtype, head)

    def described(self) -> dict:
        described = {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}
        return {**described, "dtype": str(self.dtype), **({"head": self.head} if self.head else {})}

    @property
    def stored_layers(self) -> int:
        return self.layers + self.head

    def payload_bytes(self, tokens: int) -> int:
        return self.stored_layers * 2 * self.kv_heads * tokens * self.head_dim * self.dtype.itemsize


class Rejected(Exception):
    """A file that must not be used: `reason` is foreign, truncated, corrupt (another block's content
    included), not_a_file or unreadable."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class BlockFormat:
    """The block files of one store: its `fingerprint` and `layout`, written into every header and
    checked in every read."""

    def __init__(self, fingerprint: str, layout: KVLayout):
        self.fingerprint, self.layout = fingerprint, layout

    def header(self, block: Block, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan]) -> bytes:
        """The header of the file holding tokens [block.start, block.end) of `token_ids`."""
        start, end = block.start, block.end
        return json.dumps(
            {
                "version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "layout": self.layout.described(),
                "previous": block.previous.hex(),
                "start": start,
                "tokens": token_ids[start:end].tolist(),
                "positions": positions[:, start:end].tolist(),
                "images": spans_in(images, start, end),
            }
        ).encode()

    @staticmethod
    def write(f, header: bytes, payload: torch.Tensor) -> int:
        """Write a whole block file to `f`; the bytes written."""
        data = payload.view(torch.uint8).numpy()
        f.write(_HEAD.pack(MAGIC, len(header)))
        f.write(header)
        f.write(data)
        f.write(_TRAILER.pack(zlib.crc32(data, zlib.crc32(header))))
        return _HEAD.size + len(header) + data.nbytes + _TRAILER.size

    def read_header(self, f) -> dict:
        """The file's header, checked: this format, this fingerprint and layout, a size that fits."""
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise Rejected("truncated", f"{size} bytes")
        magic, header_size = _HEAD.unpack(head)
        if magic != MAGIC:
            raise Rejected("foreign" if magic[:5] == MAGIC[:5] else "corrupt", "not a KV block of this format")
        if header_size > size:
            raise Rejected("truncated", f"{size} bytes")
        header_bytes = f.read(header_size)
        if len(header_bytes) < header_size:
            raise Rejected("truncated", f"{size} bytes")
        try:
            header = json.loads(header_bytes)
            tokens = len(header["tokens"])
        except (ValueError, KeyError, TypeError):
            raise Rejected("corrupt", "unreadable header") from None
        if header.get("fingerprint") != self.fingerprint or header.get("layout") != self.layout.described():
            raise Rejected("foreign", "made by another checkpoint, quantization or KV layout")
        if size != _HEAD.size + header_size + self.layout.payload_bytes(tokens) + _TRAILER.size:
            raise Rejected("truncated", f"{size} bytes")
        if not _well_formed(header, tokens):
            raise Rejected("corrupt", "unreadable header")
        header["_bytes"] = header_bytes
        return header

    def read_payload(self, f, header: dict) -> torch.Tensor:
        """The keys and values after a checked header, their checksum checked."""
        layout, tokens = self.layout, len(header["tokens"])
        size = layout.payload_bytes(tokens)
        payload = torch.empty(size, dtype=torch.uint8)
        if f.readinto(memoryview(payload.numpy())) != size:
            raise Rejected("truncated", "payload")
        (crc,) = _TRAILER.unpack(f.read(_TRAILER.size))
        if zlib.crc32(payload.numpy(), zlib.crc32(header["_bytes"])) != crc:
            raise Rejected("corrupt", "checksum")
        return payload.view(layout.dtype).view(layout.stored_layers, 2, layout.kv_heads, tokens, layout.head_dim)


def spans_in(images: list[VisionSpan], start: int, end: int) -> list[list]:
    """[start, end, key] of each picture and clip starting in tokens [start, end), in token order."""
    return sorted([s.start, s.end, s.key] for s in images if start <= s.start < end)


def _well_formed(header: dict, tokens: int) -> bool:
    """Whether a header has every field a read compares, of the right types and lengths."""
    positions = header.get("positions")
    return (
        isinstance(header.get("start"), int)
        and isinstance(header.get("previous"), str)
        and isinstance(header.get("images"), list)
        and all(
            isinstance(s, list) and len(s) == 3 and isinstance(s[0], int) and isinstance(s[1], int)
            for s in header["images"]
        )
        and isinstance(positions, list)
        and len(positions) == 3
        and all(isinstance(axis, list) and len(axis) == tokens for axis in positions)
    )


def differs(
    header: dict, block: Block, token_ids: torch.Tensor, positions: torch.Tensor, images: list[VisionSpan]
) -> str | None:
    """What in a block's header differs from what the request needs of tokens [block.start, block.end)
    — everything its name stands for —, or None: the chain key before it (the fingerprint and every
    token, position and picture before it), its start, tokens, M-RoPE positions, and each picture's
    and clip's content key and span."""
    start, end = block.start, block.end
    used = end - start
    if header["previous"] != block.previous.hex():
        return "it follows another prefix"
    if header["start"] != start:
        return f"it starts at token {header['start']}"
    if header["tokens"][:used] != token_ids[start:end].tolist():
        return "other tokens"
    if [axis[:used] for axis in header["positions"]] != positions[:, start:end].tolist():
        return "other M-RoPE positions"
    if sorted(s for s in header["images"] if s[0] < end) != spans_in(images, start, end):
        return "other pictures or clips"
    return None
