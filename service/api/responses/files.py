"""Stored responses on disk, where the disk tier is on (KV_DISK_MB not 0): each response a JSON file
and its pictures' and clips' pixels an .npz beside it (no pickles), written when stored — so a
response outlives its eviction from memory and a restart, and any instance of the machine can continue
it (the KV disk tier holds its keys and values). Bounded like the memory copy: RESPONSES_MAX files,
each kept RESPONSES_TTL seconds after it was last stored or read."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ...answer.tools import ToolCall
from ...media.images import DecodedImage
from ...media.video import DecodedVideo
from ...model.prompts import ChatMessage, ImagePart, TextPart, VideoPart
from .protocol import RESPONSE_ID_PATTERN

log = logging.getLogger(__name__)


def _encode(messages: list[ChatMessage]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Messages as JSON, their pixels apart (named in the JSON)."""
    arrays: dict[str, np.ndarray] = {}
    out = []
    for m in messages:
        parts = []
        for part in m.parts:
            if isinstance(part, ImagePart):
                key = f"image{len(arrays)}"
                arrays[key] = part.image.pixels
                meta = {k: v for k, v in asdict(part.image).items() if k not in ("pixels", "sent", "limits")}
                parts.append({"image": key, **meta})
            elif isinstance(part, VideoPart):
                key = f"video{len(arrays)}"
                arrays[key] = part.video.frames
                parts.append({"video": key, **{k: v for k, v in asdict(part.video).items() if k != "frames"}})
            else:
                parts.append({"text": part.text})
        calls = [{"name": c.name, "arguments": c.arguments, "id": c.id} for c in m.tool_calls]
        token_ids = list(m.token_ids) if m.token_ids is not None else None
        out.append(
            {"role": m.role, "parts": parts, "tool_calls": calls, "reasoning": m.reasoning, "token_ids": token_ids}
        )
    return out, arrays


def _image(part: dict, arrays) -> ImagePart:
    meta = {k: v for k, v in part.items() if k != "image"}
    meta["source_size"] = tuple(meta["source_size"])
    meta["oriented_size"] = tuple(meta["oriented_size"]) if meta.get("oriented_size") else None
    return ImagePart(DecodedImage(pixels=arrays[part["image"]], **meta))


def _video(part: dict, arrays) -> VideoPart:
    meta = {k: v for k, v in part.items() if k != "video"}
    meta["source_size"], meta["frame_indices"] = tuple(meta["source_size"]), tuple(meta["frame_indices"])
    return VideoPart(DecodedVideo(frames=arrays[part["video"]], **meta))


def _decode(messages: list[dict], arrays) -> list[ChatMessage]:
    out = []
    for m in messages:
        parts = [
            _image(p, arrays) if "image" in p else _video(p, arrays) if "video" in p else TextPart(p["text"])
            for p in m["parts"]
        ]
        calls = tuple(ToolCall(c["name"], c["arguments"], c["id"]) for c in m["tool_calls"])
        token_ids = tuple(m["token_ids"]) if m["token_ids"] is not None else None
        out.append(ChatMessage(m["role"], parts, token_ids=token_ids, tool_calls=calls, reasoning=m["reasoning"]))
    return out


class ResponseFiles:
    """The folder of stored responses: write, read, remove by response id. The folder is a convenience
    (responses outlive a restart): a disk that fails it leaves the responses in memory, never an error."""

    def __init__(self, folder: Path, max_files: int, ttl_seconds: float):
        self.folder, self.max_files, self.ttl = Path(folder), max_files, ttl_seconds

    def _paths(self, response_id: str) -> tuple[Path, Path] | None:
        if not re.fullmatch(RESPONSE_ID_PATTERN, response_id):  # never a path of the client's choosing
            return None
        return self.folder / f"{response_id}.json", self.folder / f"{response_id}.npz"

    def write(
        self,
        body: dict,
        messages: list[ChatMessage],
        conversation_id: str,
        owner: str = "",
        input_items: list[dict] | None = None,
    ) -> None:
        """Write one response (atomically: a reader sees it whole or not at all), then keep the
        folder within its bounds."""
        paths = self._paths(body["id"])
        if paths is None:
            return
        encoded, arrays = _encode(messages)
        document = {"body": body, "conversation_id": conversation_id, "owner": owner, "messages": encoded}
        document["input_items"] = input_items or []
        partials = [path.with_name(path.name + f".{os.getpid()}.partial") for path in paths]
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            writers = (lambda f: f.write(json.dumps(document).encode()), lambda f: np.savez(f, **arrays))
            for partial, write in zip(partials, writers):  # this user's alone: every tenant's conversations
                with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                    write(f)
            os.replace(partials[1], paths[1])  # the pictures first: a reader finds them once the JSON is there
            os.replace(partials[0], paths[0])
        except OSError as exc:  # a full or read-only disk: this response is kept in memory only
            log.warning("stored response %s not written to %s: %s", body["id"], self.folder, exc)
            for partial in partials:
                with contextlib.suppress(OSError):
                    partial.unlink()
            return
        self._bound()

    def read(self, response_id: str) -> tuple[dict, list[ChatMessage], str, str, list[dict]] | None:
        """(body, messages, conversation id, owner, input items) of a stored response, or None (unknown,
        expired, unreadable)."""
        paths = self._paths(response_id)
        if paths is None:
            return None
        try:
            if time.time() - paths[0].stat().st_mtime > self.ttl:
                self.remove(response_id)
                return None
            document = json.loads(paths[0].read_text())
            with np.load(paths[1], allow_pickle=False) as arrays:
                messages = _decode(document["messages"], {k: arrays[k] for k in arrays.files})
            os.utime(paths[0])  # read: kept another TTL
        except (OSError, ValueError, KeyError, TypeError):
            return None
        owner, items = document.get("owner", ""), document.get("input_items", [])  # files written before them: none
        return document["body"], messages, document["conversation_id"], owner, items

    def remove(self, response_id: str) -> bool:
        paths = self._paths(response_id)
        removed = False
        for path in paths or ():
            try:
                path.unlink()
                removed = True
            except FileNotFoundError:
                pass
        return removed

    def _bound(self) -> None:
        """The oldest beyond max_files and the expired go (another instance may remove some first)."""
        dated = []
        for path in self.folder.glob("resp_*.json"):
            try:
                dated.append((path.stat().st_mtime, path.stem))
            except FileNotFoundError:
                continue
        dated.sort()
        now = time.time()
        for i, (mtime, response_id) in enumerate(dated):
            if len(dated) - i > self.max_files or now - mtime > self.ttl:
                self.remove(response_id)
