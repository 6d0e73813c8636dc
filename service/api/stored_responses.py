"""Stored responses (the Responses API's `store`): each response as it was answered, and the
conversation it ends — its input and output as the engine's messages, pictures decoded and the
answer's own token ids — so `previous_response_id` continues it and the KV cache finds it whole.
Bounded in count, bytes and idle time (RESPONSES_MAX, RESPONSES_MAX_BYTES, RESPONSES_TTL), evictions
counted like the caches' (cache="responses")."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..caches.lru import BudgetedLRU
from ..model.prompts import ChatMessage
from .histories import messages_bytes


@dataclass(frozen=True)
class StoredResponse:
    body: dict  # the response object, as answered
    messages: list[ChatMessage]  # the conversation so far, its answer included (instructions apart)
    conversation_id: str  # the chain's key in the conversation cache: the first response's id


class ResponseStore:
    """response id → StoredResponse."""

    def __init__(self, max_responses: int, ttl_seconds: float, max_bytes: int):
        self.entries: BudgetedLRU[StoredResponse] = BudgetedLRU("responses", max_bytes, max_responses, ttl_seconds)

    @staticmethod
    def new_id() -> str:
        return "resp_" + uuid.uuid4().hex

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (unknown, expired, evicted or deleted)."""
        return self.entries.get(response_id)

    def save(self, stored: StoredResponse) -> None:
        """Keep it (one larger than the whole byte budget is not kept)."""
        size = messages_bytes(stored.messages) + len(json.dumps(stored.body))
        self.entries.put(stored.body["id"], stored, size)

    def delete(self, response_id: str) -> bool:
        """Forget it; False if it was not there."""
        with self.entries.lock:
            if self.entries.peek(response_id) is None:
                return False
            self.entries.pop(response_id)
            return True
