"""A hybrid model's (Qwen3.5) recurrent states on disk, beside its keys and values.

Keys and values can be cut at any token; a recurrent state exists only where the prefill kept one (a
snapshot: service/model/hybrid.py) or where a cache ends. So a kept hybrid cache writes, besides its
attention layers' blocks, a state file per snapshot and one for its end, each named like a block by the
chain: the key of the full block before it, then the key of its own tokens since that block (the same
`chain`), so a file's name stands for every token, position and picture before its state. A lookup asks
for the request's own snapshot positions (where an earlier request sharing the prefix kept its state:
turn starts and ends, assistant headers, every STATE_SNAPSHOT_TOKENS) from the longest down and stats
their names; a read checks the header as a block's (everything the name stands for) and a CRC-32.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ...model.prompts import VisionSpan
from .block_format import MAGIC, Rejected, differs, spans_in
from .names import BLOCK_TOKENS, FORMAT_VERSION, Block, BlockNames, chain

STATE_MAGIC = MAGIC[:5] + b"ST" + MAGIC[7:]
_HEAD = struct.Struct("<8sI")  # magic, header length
_TRAILER = struct.Struct("<I")  # CRC-32 of header and payload


@dataclass(frozen=True)
class StateLayout:
    """One snapshot's payload: per linear-attention layer, its convolution's last inputs (kernel - 1 ×
    channels) then its recurrent matrices (value heads × key dim × value dim), then (`hidden` floats,
    0 without) the model's final hidden state at the snapshot's last position — what a multi-token
    prediction head resumes from (service/model/mtp.py) — fp32."""

    layers: int
    conv: tuple[int, int]
    state: tuple[int, int, int]
    hidden: int = 0

    @classmethod
    def of_shape(cls, shape, layer_types: list[str], hidden: int = 0) -> StateLayout:
        """A model's: its linear-attention layers' `Shape` (service/model/deltanet.py) and how many there
        are, and the hidden size when its head drafts."""
        conv = (shape.kernel - 1, shape.conv_channels)
        state = (shape.value_heads, shape.key_dim, shape.value_dim)
        return cls(layer_types.count("linear_attention"), conv, state, hidden)

    def described(self) -> dict:
        described = {"layers": self.layers, "conv": list(self.conv), "state": list(self.state)}
        return {**described, **({"hidden": self.hidden} if self.hidden else {})}

    @property
    def floats(self) -> int:
        per_layer = self.conv[0] * self.conv[1] + self.state[0] * self.state[1] * self.state[2]
        return self.layers * per_layer + self.hidden


def state_block(names: BlockNames, token_ids, positions, images: list[VisionSpan], at: int, namespace: str) -> Block:
    """The state file of `at` tokens: a Block of tokens [the last full block's end, at) after that block's key."""
    previous, floor = names.seed_of(namespace), 0
    for block, key in names.full_blocks(token_ids, positions, images, at, namespace):
        previous, floor = key, block.end
    key = chain(previous, token_ids, positions, floor, at, images)
    return Block(names.root / previous.hex()[:2] / f"{previous.hex()}-{key.hex()}.state", floor, at, previous)


class StateFormat:
    """State files of one store: its `fingerprint`, written in every header and checked in every read."""

    def __init__(self, fingerprint: str):
        self.fingerprint = fingerprint

    def write(self, path: Path, block: Block, token_ids, positions, images, states: list, hidden=None) -> int:
        """Write the state (each linear layer's (conv, state), and the head's `hidden` state, 1 × hidden)
        at `block.end` tokens to `path`, whole or not at all; the bytes written."""
        width = 0 if hidden is None else hidden.numel()
        layout = StateLayout(len(states), tuple(states[0][0].shape), tuple(states[0][1].shape), width)
        header = json.dumps(
            {
                "version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "state_layout": layout.described(),
                "previous": block.previous.hex(),
                "start": block.start,
                "end": block.end,
                "tokens": token_ids[block.start : block.end].tolist(),
                "positions": positions[:, block.start : block.end].tolist(),
                "images": spans_in(images, block.start, block.end),
            }
        ).encode()
        tensors = [t.reshape(-1) for pair in states for t in pair] + ([hidden.reshape(-1)] if width else [])
        payload = torch.cat(tensors).float().numpy()
        temporary = path.parent / f".tmp-{path.stem}-{os.getpid()}"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(temporary, "wb") as f:
                f.write(_HEAD.pack(STATE_MAGIC, len(header)))
                f.write(header)
                f.write(payload.tobytes())
                f.write(_TRAILER.pack(zlib.crc32(payload, zlib.crc32(header))))
            os.replace(temporary, path)
        finally:
            if temporary.exists():
                temporary.unlink()
        return _HEAD.size + len(header) + payload.nbytes + _TRAILER.size

    def read(self, f, block: Block, token_ids, positions, images, layout: StateLayout) -> tuple[list, torch.Tensor]:
        """The states of a state file (each linear layer's (conv, state)) and the head's hidden state
        (1 × hidden; 0 wide without), every check passed: this format and fingerprint, the layout the
        model needs, everything its name stands for, the checksum."""
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise Rejected("truncated", "no header")
        magic, size = _HEAD.unpack(head)
        if magic != STATE_MAGIC:
            raise Rejected("foreign" if magic[:5] == MAGIC[:5] else "corrupt", "not a state file of this format")
        header_bytes = f.read(size)
        try:
            header = json.loads(header_bytes)
            tokens = len(header["tokens"])
        except (ValueError, KeyError, TypeError):
            raise Rejected("corrupt", "unreadable header") from None
        if header.get("fingerprint") != self.fingerprint or header.get("state_layout") != layout.described():
            raise Rejected("foreign", "made by another checkpoint, quantization or model")
        if header.get("end") != block.end or tokens != block.end - block.start:
            raise Rejected("corrupt", "another position's state")
        wrong = differs(header, block, token_ids, positions, images)
        if wrong:
            raise Rejected("corrupt", f"another prefix's state: {wrong}")
        payload = torch.empty(layout.floats, dtype=torch.float32)
        if f.readinto(memoryview(payload.numpy()).cast("B")) != layout.floats * 4:
            raise Rejected("truncated", "payload")
        (crc,) = _TRAILER.unpack(f.read(_TRAILER.size))
        if zlib.crc32(payload.numpy(), zlib.crc32(header_bytes)) != crc:
            raise Rejected("corrupt", "checksum")
        states, at = [], 0
        for _ in range(layout.layers):
            conv_floats, state_floats = layout.conv[0] * layout.conv[1], int(torch.Size(layout.state).numel())
            conv = payload[at : at + conv_floats].view(layout.conv)
            at += conv_floats
            states.append((conv, payload[at : at + state_floats].view(layout.state)))
            at += state_floats
        return states, payload[at:].view(1, layout.hidden)


def points_within(points: list[int], tokens: int) -> list[int]:
    """The snapshot positions a lookup may resume at, longest first: up to `tokens`, past the first block."""
    return sorted((p for p in points if BLOCK_TOKENS <= p <= tokens), reverse=True)
