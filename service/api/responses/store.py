"""Stored responses (the Responses API's `store`): each response as it was answered, and the
conversation it ends — its input and output as the engine's messages, pictures decoded and the
answer's own token ids — so `previous_response_id` continues it and the KV cache finds it whole.
Bounded in count, bytes and idle time (RESPONSES_MAX, RESPONSES_MAX_BYTES, RESPONSES_TTL), evictions
counted like the caches' (cache="responses"). Where a shared store is on (service/shared/: the Redis of
JOB_STORE_URL) they live there, per tenant within the same bounds, and any instance on any machine
continues them; else, where the disk tier is on, a copy on disk (files.py) outlives an eviction and a
restart and serves the machine's instances."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ...caches.lru import BudgetedLRU
from ...model.prompts import ChatMessage, messages_bytes
from ...settings import Settings
from ...shared import codec
from ...shared.affinity import new_id
from ...shared.layered import LayeredStore
from ...shared.link import SharedLink
from ...shared.pictures import Pictures
from ...shared.records import SharedRecords
from .files import ResponseFiles


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as answered
    messages: list[ChatMessage]  # the conversation so far, its answer included (instructions apart)
    conversation_id: str  # the chain's key in the conversation cache: the first response's id
    owner: str = ""  # the tenant's owner hash (service/api/access/tenants.py): nobody else's requests find it
    input_items: list[dict] = field(default_factory=list)  # what GET …/input_items lists (serving.input_items)


def _size(stored: StoredResponse) -> int:
    return messages_bytes(stored.messages) + len(json.dumps(stored.body)) + len(json.dumps(stored.input_items))


class ResponseStore:
    """response id → StoredResponse: in the shared store where there is one (with this instance's copy),
    else in memory and (`files`, where the disk tier is on) on disk."""

    def __init__(
        self,
        max_responses: int,
        ttl_seconds: float,
        max_bytes: int,
        files: ResponseFiles | None = None,
        shared: SharedLink | None = None,
        pictures: Pictures | None = None,
    ):
        local = BudgetedLRU("responses", max_bytes, max_responses, ttl_seconds)
        records = SharedRecords(shared, "responses", max_responses, max_bytes, ttl_seconds) if shared else None
        self.pictures = pictures or Pictures()
        self.entries = LayeredStore(local, records, self._to_blob, self._from_blob, _size)
        self.files = files if shared is None else None  # the shared store outlives a restart by itself

    @classmethod
    def from_settings(
        cls, settings: Settings, shared: SharedLink | None = None, pictures: Pictures | None = None
    ) -> ResponseStore:
        """Bounded by RESPONSES_MAX, RESPONSES_MAX_BYTES and RESPONSES_TTL (per tenant in the shared store);
        without one, on disk too (CACHE_DIR/responses) where the KV disk tier is on."""
        s = settings
        on_disk = s.cache_enabled and s.kv_disk_mb != 0
        files = ResponseFiles(s.cache_dir / "responses", s.responses_max, s.responses_ttl) if on_disk else None
        return cls(s.responses_max, s.responses_ttl, s.responses_max_bytes, files, shared, pictures)

    @staticmethod
    def new_id(affinity_key: str | None = None) -> str:
        """A new response's id, beginning with the request's affinity key (shared/affinity.py)."""
        return new_id("resp_", affinity_key, 16)

    def _to_blob(self, stored: StoredResponse) -> bytes:
        record = {"body": stored.body, "conversation_id": stored.conversation_id, "owner": stored.owner}
        return codec.encode({**record, "input_items": stored.input_items}, stored.messages, self.pictures)

    def _from_blob(self, blob: bytes) -> StoredResponse:
        record, messages = codec.decode(blob, self.pictures)
        return StoredResponse(
            record["body"], messages, record["conversation_id"], record["owner"], record["input_items"]
        )

    def get(self, response_id: str, owner: str = "") -> StoredResponse | None:
        """`owner`'s stored response, or None (unknown, expired, evicted without a copy elsewhere, deleted,
        or another tenant's: answered alike)."""
        stored = self.entries.get(owner, response_id)
        if stored is None and self.files is not None:
            found = self.files.read(response_id)
            if found is not None and found[3] == owner:
                stored = StoredResponse(*found)
                self.entries.keep_here(owner, response_id, stored)
        return stored

    def save(self, stored: StoredResponse) -> None:
        """Keep it (in memory unless larger than the whole byte budget; shared, or on disk, where on)."""
        self.entries.put(stored.owner, stored.body["id"], stored)
        if self.files is not None:
            self.files.write(stored.body, stored.messages, stored.conversation_id, stored.owner, stored.input_items)

    def delete(self, response_id: str, owner: str = "") -> bool:
        """Forget `owner`'s response everywhere; False if nobody held it (or it is another's). 503 while a
        shared store is down (service/shared/layered.py)."""
        on_disk = self.files is not None and self.get(response_id, owner) is not None
        existed = self.entries.delete(owner, response_id)
        if on_disk:
            existed = self.files.remove(response_id) or existed
        return existed
