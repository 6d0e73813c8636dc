"""Server-side chat histories for the native endpoint, where a client sends only its new message
and a `conversation_id`: the messages, not their keys and values (those are the engine's
conversation cache, service/caches/). Bounded in count, bytes (decoded images dominate) and idle
time, with evictions counted like the caches' (cache="history"). A conversation belongs to its tenant
(`owner`, service/api/access/tenants.py): another tenant's same id is another conversation, and finds
nothing of this one — exactly as an id never used."""

from __future__ import annotations

import uuid

from ...caches.lru import BudgetedLRU
from ...model.prompts import ChatMessage, messages_bytes
from ...settings import Settings


def _key(owner: str, conversation_id: str) -> str:
    return f"{owner}/{conversation_id}" if owner else conversation_id  # ids hold no '/'


class HistoryStore:
    """(owner, conversation_id) → messages so far (images kept decoded, so an evicted KV cache can be
    rebuilt)."""

    def __init__(self, max_histories: int, ttl_seconds: float, max_bytes: int):
        self.entries: BudgetedLRU[list[ChatMessage]] = BudgetedLRU("history", max_bytes, max_histories, ttl_seconds)

    @classmethod
    def from_settings(cls, settings: Settings) -> HistoryStore:
        """Bounded by CONVERSATION_HISTORY_MAX, CONVERSATION_HISTORY_MAX_BYTES and CONVERSATION_HISTORY_TTL."""
        s = settings
        return cls(s.conversation_history_max, s.conversation_history_ttl, s.conversation_history_max_bytes)

    @staticmethod
    def new_id() -> str:
        return "conv-" + uuid.uuid4().hex[:20]

    def history(self, conversation_id: str, owner: str = "") -> list[ChatMessage]:
        """`owner`'s stored messages (a copy), or [] for an unknown, expired or evicted conversation, or
        another owner's."""
        return list(self.entries.get(_key(owner, conversation_id)) or [])

    def save(self, conversation_id: str, messages: list[ChatMessage], owner: str = "") -> None:
        """Keep `owner`'s conversation (replacing its earlier turns); one larger than the whole byte
        budget is not kept."""
        self.entries.put(_key(owner, conversation_id), list(messages), messages_bytes(messages))

    @property
    def bytes(self) -> int:
        return self.entries.nbytes

    def __len__(self) -> int:
        return len(self.entries)
