"""A record and the conversation it holds as bytes, and back: the record's own fields (JSON), each
message — role, texts, pictures and clips (pictures.py), tool calls, reasoning, and an answer's own
token ids, so the next turn's prompt is the same tokens on any machine — and the pictures' bytes after
the JSON. `MAGIC` marks the layout: a record of another layout is refused, never misread."""

from __future__ import annotations

import json
import struct

from ..answer.tools import ToolCall
from ..model.prompts import ChatMessage, ImagePart, TextPart, VideoPart
from .pictures import Pictures

MAGIC = b"qwen3vl-state-1\n"
_LENGTH = struct.Struct(">I")


class RecordCorrupt(ValueError):
    """Bytes that are no record of this layout."""


def encode(record: dict, messages: list[ChatMessage], pictures: Pictures) -> bytes:
    """`record` (JSON-able) and `messages` as one blob."""
    blobs: list[bytes] = []
    encoded = []
    for m in messages:
        parts = []
        for part in m.parts:
            if isinstance(part, ImagePart):
                meta, data = pictures.image(part.image)
                parts.append({"image": meta, "blob": len(blobs)})
                blobs.append(data)
            elif isinstance(part, VideoPart):
                meta, data = pictures.video(part.video)
                parts.append({"video": meta, "blob": len(blobs)})
                blobs.append(data)
            else:
                parts.append({"text": part.text})
        encoded.append(
            {
                "role": m.role,
                "parts": parts,
                "token_ids": list(m.token_ids) if m.token_ids is not None else None,
                "tool_calls": [[c.name, c.arguments, c.id] for c in m.tool_calls],
                "reasoning": m.reasoning,
            }
        )
    head = json.dumps({"record": record, "messages": encoded, "blobs": [len(b) for b in blobs]}).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(head)), head, *blobs])


def decode(blob: bytes, pictures: Pictures) -> tuple[dict, list[ChatMessage]]:
    """(record, messages) of a blob `encode` wrote; RecordCorrupt, or PictureMismatch, if it is not one."""
    if not blob.startswith(MAGIC):
        raise RecordCorrupt("not a record of this layout")
    start = len(MAGIC) + _LENGTH.size
    try:
        (length,) = _LENGTH.unpack_from(blob, len(MAGIC))
        head = json.loads(blob[start : start + length])
    except (struct.error, ValueError) as exc:
        raise RecordCorrupt(f"a record's head is unreadable: {exc}") from None
    offsets, at = [], start + length
    for size in head["blobs"]:
        offsets.append((at, at + size))
        at += size
    if at != len(blob):
        raise RecordCorrupt("a record's length is not what its head says")
    messages = []
    for m in head["messages"]:
        parts = []
        for part in m["parts"]:
            if "image" in part:
                low, high = offsets[part["blob"]]
                parts.append(ImagePart(pictures.read_image(part["image"], blob[low:high])))
            elif "video" in part:
                low, high = offsets[part["blob"]]
                parts.append(VideoPart(pictures.read_video(part["video"], blob[low:high])))
            else:
                parts.append(TextPart(part["text"]))
        token_ids = tuple(m["token_ids"]) if m["token_ids"] is not None else None
        calls = tuple(ToolCall(*c) for c in m["tool_calls"])
        messages.append(ChatMessage(m["role"], parts, token_ids=token_ids, tool_calls=calls, reasoning=m["reasoning"]))
    return head["record"], messages
