"""Stored responses (the Responses API's `store`): each response as it was answered, and the
conversation it ends — its input and output as the engine's messages, pictures decoded and the
answer's own token ids — so `previous_response_id` continues it and the KV cache finds it whole.
Bounded in count, bytes and idle time (RESPONSES_MAX, RESPONSES_MAX_BYTES, RESPONSES_TTL), evictions
counted like the caches' (cache="responses"); where the disk tier is on, a copy on disk
(files.py) outlives an eviction and a restart."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from ...caches.lru import BudgetedLRU
from ...model.prompts import ChatMessage, messages_bytes
from ...settings import Settings
from .files import ResponseFiles


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as answered
    messages: list[ChatMessage]  # the conversation so far, its answer included (instructions apart)
    conversation_id: str  # the chain's key in the conversation cache: the first response's id
    owner: str = ""  # the tenant's owner hash (service/api/access/tenants.py): nobody else's requests find it
    input_items: list[dict] = field(default_factory=list)  # what GET …/input_items lists (serving.input_items)


class ResponseStore:
    """response id → StoredResponse, in memory and (`files`, where the disk tier is on) on disk."""

    def __init__(self, max_responses: int, ttl_seconds: float, max_bytes: int, files: ResponseFiles | None = None):
        self.entries: BudgetedLRU[StoredResponse] = BudgetedLRU("responses", max_bytes, max_responses, ttl_seconds)
        self.files = files

    @classmethod
    def from_settings(cls, settings: Settings) -> ResponseStore:
        """Bounded by RESPONSES_MAX, RESPONSES_MAX_BYTES and RESPONSES_TTL; on disk too (CACHE_DIR/responses)
        where the KV disk tier is on."""
        s = settings
        on_disk = s.cache_enabled and s.kv_disk_mb != 0
        files = ResponseFiles(s.cache_dir / "responses", s.responses_max, s.responses_ttl) if on_disk else None
        return cls(s.responses_max, s.responses_ttl, s.responses_max_bytes, files)

    @staticmethod
    def new_id() -> str:
        return "resp_" + uuid.uuid4().hex

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """`owner`'s stored response, from memory or else from disk, or None (unknown, expired, evicted
        without a disk copy, deleted, or another tenant's: answered alike)."""
        stored = self.entries.get(response_id)
        if stored is None and self.files is not None:
            found = self.files.read(response_id)
            if found is not None:
                stored = StoredResponse(*found)
                self._keep(stored)
        return stored if stored is not None and stored.owner == owner else None

    def save(self, stored: StoredResponse) -> None:
        """Keep it (in memory unless larger than the whole byte budget; on disk where it is on)."""
        self._keep(stored)
        if self.files is not None:
            self.files.write(stored.body, stored.messages, stored.conversation_id, stored.owner, stored.input_items)

    def _keep(self, stored: StoredResponse) -> None:
        size = messages_bytes(stored.messages) + len(json.dumps(stored.body)) + len(json.dumps(stored.input_items))
        self.entries.put(stored.body["id"], stored, size)

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Forget `owner`'s response, in memory and on disk; False if it was in neither (or another's)."""
        if self.get(response_id, owner) is None:
            return False
        with self.entries.lock:
            in_memory = self.entries.peek(response_id) is not None
            if in_memory:
                self.entries.pop(response_id)
        on_disk = self.files is not None and self.files.remove(response_id)
        return in_memory or on_disk
