"""Server-side chat histories for the native endpoint, where a client sends only its new message
and a `conversation_id`: the messages, not their keys and values (those are the engine's
conversation cache, service/caches/). Bounded in count, bytes (decoded images dominate) and idle
time, with evictions counted like the caches' (cache="history"). Where a shared store is on
(service/shared/: the Redis of JOB_STORE_URL), the histories live there, per tenant within the same
bounds, so any instance on any machine continues any conversation; this instance keeps a copy to serve
from while the store is down. A conversation belongs to its tenant (`owner`,
service/api/access/tenants.py): another tenant's same id is another conversation, and finds nothing of
this one — exactly as an id never used."""

from __future__ import annotations

from functools import partial

from ...caches.lru import BudgetedLRU
from ...model.prompts import ChatMessage, messages_bytes
from ...settings import Settings
from ...shared import codec
from ...shared.affinity import new_id
from ...shared.layered import LayeredStore
from ...shared.link import SharedLink
from ...shared.pictures import Pictures
from ...shared.records import SharedRecords


def _to_blob(pictures: Pictures, messages: list[ChatMessage]) -> bytes:
    return codec.encode({}, messages, pictures)


def _from_blob(pictures: Pictures, blob: bytes) -> list[ChatMessage]:
    return codec.decode(blob, pictures)[1]


class HistoryStore:
    """(owner, conversation_id) → messages so far (images kept decoded, so an evicted KV cache can be
    rebuilt), in the shared store too where there is one (`shared`)."""

    def __init__(
        self,
        max_histories: int,
        ttl_seconds: float,
        max_bytes: int,
        shared: SharedLink | None = None,
        pictures: Pictures | None = None,
    ):
        local = BudgetedLRU("history", max_bytes, max_histories, ttl_seconds)
        records = SharedRecords(shared, "history", max_histories, max_bytes, ttl_seconds) if shared else None
        pictures = pictures or Pictures()
        self.entries = LayeredStore(
            local, records, partial(_to_blob, pictures), partial(_from_blob, pictures), messages_bytes
        )

    @classmethod
    def from_settings(
        cls, settings: Settings, shared: SharedLink | None = None, pictures: Pictures | None = None
    ) -> HistoryStore:
        """Bounded by CONVERSATION_HISTORY_MAX, CONVERSATION_HISTORY_MAX_BYTES and CONVERSATION_HISTORY_TTL
        (per tenant in the shared store)."""
        s = settings
        return cls(
            s.conversation_history_max, s.conversation_history_ttl, s.conversation_history_max_bytes, shared, pictures
        )

    @staticmethod
    def new_id(affinity_key: str | None = None) -> str:
        """A new conversation's id, beginning with the request's affinity key (shared/affinity.py)."""
        return new_id("conv-", affinity_key, 12)

    def history(self, conversation_id: str, owner: str = "") -> list[ChatMessage]:
        """`owner`'s stored messages (a copy), or [] for an unknown, expired or evicted conversation, or
        another owner's."""
        return list(self.entries.get(owner, conversation_id) or [])

    def save(self, conversation_id: str, messages: list[ChatMessage], owner: str = "") -> None:
        """Keep `owner`'s conversation (replacing its earlier turns); one larger than the whole byte
        budget is not kept."""
        self.entries.put(owner, conversation_id, list(messages))

    @property
    def bytes(self) -> int:
        return self.entries.local.nbytes

    def __len__(self) -> int:
        return len(self.entries.local)
