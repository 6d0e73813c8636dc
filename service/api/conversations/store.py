"""Conversations kept (CONVERSATIONS_MAX, CONVERSATIONS_MAX_BYTES, CONVERSATIONS_TTL): each its
metadata, its items as listed, and the engine's messages they stand for — an answer's with its own token
ids, so a turn continues the KV cache of the last one token for token. Items come in segments, what one
call added (a create, an add, a response's input and output): a segment's messages are rebuilt from its
items when one of them is deleted. In the shared store where there is one (service/shared/), per tenant,
so any instance on any machine continues any conversation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ...caches.lru import BudgetedLRU
from ...model.prompts import ChatMessage, messages_bytes
from ...settings import Settings
from ...shared import codec
from ...shared.affinity import new_id
from ...shared.layered import LayeredStore
from ...shared.link import SharedLink
from ...shared.pictures import Pictures
from ...shared.records import SharedRecords


@dataclass(frozen=True)
class Segment:
    """What one call added: its items as listed, and how many of the conversation's messages they are."""

    items: list[dict]
    messages: int


@dataclass(frozen=True)
class StoredConversation:
    id: str
    created_at: int
    owner: str
    metadata: dict[str, str] = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    messages: list[ChatMessage] = field(default_factory=list)  # every segment's, in order

    @property
    def items(self) -> list[dict]:
        return [item for segment in self.segments for item in segment.items]


def _size(conversation: StoredConversation) -> int:
    return messages_bytes(conversation.messages) + sum(len(repr(s.items)) for s in conversation.segments)


class ConversationStore:
    """(owner, conversation id) → StoredConversation."""

    def __init__(
        self,
        max_conversations: int,
        ttl_seconds: float,
        max_bytes: int,
        shared: SharedLink | None = None,
        pictures: Pictures | None = None,
    ):
        local = BudgetedLRU("conversations", max_bytes, max_conversations, ttl_seconds)
        records = SharedRecords(shared, "conversations", max_conversations, max_bytes, ttl_seconds) if shared else None
        self.pictures = pictures or Pictures()
        self.entries = LayeredStore(local, records, self._to_blob, self._from_blob, _size)

    @classmethod
    def from_settings(
        cls, settings: Settings, shared: SharedLink | None = None, pictures: Pictures | None = None
    ) -> ConversationStore:
        s = settings
        return cls(s.conversations_max, s.conversations_ttl, s.conversations_max_bytes, shared, pictures)

    @staticmethod
    def new_id(affinity_key: str | None = None) -> str:
        """A new conversation's id, beginning with the request's affinity key (shared/affinity.py)."""
        return new_id("conv_", affinity_key, 32)

    def _to_blob(self, c: StoredConversation) -> bytes:
        segments = [{"items": s.items, "messages": s.messages} for s in c.segments]
        record = {"id": c.id, "created_at": c.created_at, "owner": c.owner, "metadata": c.metadata}
        return codec.encode({**record, "segments": segments}, c.messages, self.pictures)

    def _from_blob(self, blob: bytes) -> StoredConversation:
        record, messages = codec.decode(blob, self.pictures)
        segments = [Segment(s["items"], s["messages"]) for s in record["segments"]]
        return StoredConversation(
            record["id"], record["created_at"], record["owner"], record["metadata"], segments, messages
        )

    def get(self, conversation_id: str, owner: str = "") -> StoredConversation | None:
        """`owner`'s conversation, or None (unknown, expired, evicted, deleted, another tenant's: alike)."""
        return self.entries.get(owner, conversation_id)

    def save(self, conversation: StoredConversation) -> None:
        """Keep a new conversation (a change to one is `update`)."""
        self.entries.put(conversation.owner, conversation.id, conversation)

    def update(
        self, conversation_id: str, owner: str, change: Callable[[StoredConversation], StoredConversation]
    ) -> StoredConversation | None:
        """Change `owner`'s conversation in one step — `change` is given it as it is now, and made again if
        another request (on this instance or another) changed it meanwhile, so concurrent changes are all
        kept — and return it changed; None (nothing changed) for a conversation not there."""
        return self.entries.update(owner, conversation_id, change)

    def add_turn(
        self, conversation_id: str, owner: str, input_items: list[dict], output_items: list[dict], messages: list
    ) -> None:
        """Add a response's turn (one segment) after the conversation's items as they are now: its input
        items, its output items, and the messages they are — the input's and the answer, with its generated
        ids. A conversation deleted meanwhile stays deleted."""
        segment = Segment(input_items + output_items, len(messages))
        self.update(
            conversation_id,
            owner,
            lambda c: replace(c, segments=[*c.segments, segment], messages=c.messages + messages),
        )

    def delete(self, conversation_id: str, owner: str = "") -> bool:
        """Forget it; False if there was none. 503 while a shared store is down (shared/layered.py)."""
        return self.entries.delete(owner, conversation_id)
