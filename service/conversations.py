"""Server-side chat histories for the native endpoint, where a client sends only its new message
and a `conversation_id`. Bounded in count and idle time; the KV cache is separate (caches.py)."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict

from .prompts import ChatMessage


class ConversationStore:
    """conversation_id → messages so far (images kept decoded, so an evicted KV cache can be rebuilt)."""

    def __init__(self, max_conversations: int, ttl_seconds: float):
        self.max_conversations = max_conversations
        self.ttl_seconds = ttl_seconds
        self._items: OrderedDict[str, tuple[float, list[ChatMessage]]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return "conv-" + uuid.uuid4().hex[:20]

    def history(self, conversation_id: str) -> list[ChatMessage]:
        """The stored messages (a copy), or [] for an unknown or expired conversation."""
        with self._lock:
            self._expire()
            item = self._items.get(conversation_id)
            return list(item[1]) if item else []

    def save(self, conversation_id: str, messages: list[ChatMessage]) -> None:
        with self._lock:
            self._items[conversation_id] = (time.monotonic(), list(messages))
            self._items.move_to_end(conversation_id)
            while len(self._items) > self.max_conversations:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.ttl_seconds
        while self._items:
            key, (stamp, _) = next(iter(self._items.items()))
            if stamp >= cutoff:
                break
            del self._items[key]
