"""Server-side chat histories for the native endpoint, where a client sends only its new message
and a `conversation_id`. Bounded in count, bytes (decoded images dominate) and idle time; the KV
cache is separate (caches.py)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict

from .prompts import ChatMessage


def _nbytes(messages: list[ChatMessage]) -> int:
    return sum(img.pixels.nbytes for m in messages for img in m.images) + \
        sum(video.nbytes for m in messages for video in m.videos) + \
        sum(len(getattr(p, "text", "")) for m in messages for p in m.parts) + \
        sum(8 * len(m.token_ids or ()) for m in messages)


class ConversationStore:
    """conversation_id → messages so far (images kept decoded, so an evicted KV cache can be rebuilt)."""

    def __init__(self, max_conversations: int, ttl_seconds: float, max_bytes: int):
        self.max_conversations = max_conversations
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, tuple[float, int, list[ChatMessage]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return "conv-" + uuid.uuid4().hex[:20]

    def history(self, conversation_id: str) -> list[ChatMessage]:
        """The stored messages (a copy), or [] for an unknown, expired or evicted conversation."""
        with self._lock:
            self._expire()
            item = self._items.get(conversation_id)
            return list(item[2]) if item else []

    def save(self, conversation_id: str, messages: list[ChatMessage]) -> None:
        size = _nbytes(messages)
        with self._lock:
            self._drop(conversation_id)
            if size > self.max_bytes:
                return  # larger than the whole budget: not remembered
            self._items[conversation_id] = (time.monotonic(), size, list(messages))
            self.bytes += size
            while len(self._items) > self.max_conversations or self.bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, conversation_id: str) -> None:
        item = self._items.pop(conversation_id, None)
        if item:
            self.bytes -= item[1]

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_seconds
        while self._items:
            key, (stamp, _, _) = next(iter(self._items.items()))
            if stamp >= cutoff:
                break
            self._drop(key)
