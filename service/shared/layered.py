"""A store of one kind of record that many instances share: the shared records (records.py) are the
truth where there are any, and this instance keeps a copy of what it wrote or read, bounded like today's
stores, to serve from while they cannot be reached. Without a shared store it is that copy alone, as
before. What is written while the shared store is down is marked so, and goes up as soon as the store is
back (`write_up`) — or, where that has not happened yet, when it is read here — so another instance
continues each conversation from its latest turn; a copy the store no longer holds (expired, evicted,
deleted by another instance) is dropped, never brought back. A delete needs the shared store (503 while
it is down): done on one instance alone, the record would come back from the store."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..caches.lru import BudgetedLRU
from ..errors import SharedStateUnavailable
from .codec import RecordCorrupt
from .link import SharedUnavailable
from .pictures import PictureMismatch
from .records import SharedRecords

log = logging.getLogger("service.shared")
V = TypeVar("V")


@dataclass
class _Copy(Generic[V]):
    value: V
    shared: str | None  # the digest of the blob the shared store holds for it; None: not written there


def _digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


class LayeredStore(Generic[V]):
    """(owner, id) → a value: `shared` (or None) and a local copy `local`. `to_blob` / `from_blob`
    turn a value into bytes and back (codec.py), `size_of` is what its local copy costs."""

    def __init__(
        self,
        local: BudgetedLRU,
        shared: SharedRecords | None,
        to_blob: Callable[[V], bytes],
        from_blob: Callable[[bytes], V],
        size_of: Callable[[V], int],
    ):
        self.local, self.shared = local, shared
        self._to_blob, self._from_blob, self._size_of = to_blob, from_blob, size_of
        if shared is not None:
            shared.link.on_back.append(self.write_up)

    @staticmethod
    def _key(owner: str, record_id: str) -> str:
        return f"{owner}/{record_id}"

    def get(self, owner: str, record_id: str) -> V | None:
        """The value, or None (unknown, expired, evicted or deleted, or another owner's: alike)."""
        key = self._key(owner, record_id)
        if self.shared is None:
            return self._local(key)
        try:
            blob = self.shared.get(owner, record_id)
        except SharedUnavailable:
            return self._local(key)
        if blob is None:
            return self._not_shared(owner, record_id)
        digest = _digest(blob)
        copy = self.local.get(key)
        if copy is not None and copy.shared == digest:
            return copy.value  # the copy is what the store holds: no decoding
        if copy is not None and copy.shared is None:  # written here while the store was down: newer
            self.put(owner, record_id, copy.value)
            return copy.value
        try:
            value = self._from_blob(blob)
        except (RecordCorrupt, PictureMismatch, KeyError, TypeError, ValueError) as exc:
            log.error("shared %s record %s unreadable (%s): treated as gone", self.shared.kind, record_id, exc)
            return None
        self.local.put(key, _Copy(value, digest), self._size_of(value))
        return value

    def put(self, owner: str, record_id: str, value: V) -> None:
        """Keep it here and, where there is a shared store, there (here alone while it is down)."""
        key = self._key(owner, record_id)
        size = self._size_of(value)
        if self.shared is None:
            self.local.put(key, _Copy(value, None), size)
            return
        blob = self._to_blob(value)
        try:
            kept = self.shared.put(owner, record_id, blob)
        except SharedUnavailable:
            kept = False
        self.local.put(key, _Copy(value, _digest(blob) if kept else None), size)

    def keep_here(self, owner: str, record_id: str, value: V) -> None:
        """Keep a copy here alone (found in another store of this machine's: a disk copy)."""
        self.local.put(self._key(owner, record_id), _Copy(value, None), self._size_of(value))

    def delete(self, owner: str, record_id: str) -> bool:
        """Forget it everywhere; False if nobody held it. SharedStateUnavailable (503) while the shared
        store is down: a delete made here alone would be undone by the store when it is back."""
        key = self._key(owner, record_id)
        existed = False
        if self.shared is not None:
            try:
                existed = self.shared.delete(owner, record_id)
            except SharedUnavailable as exc:
                raise SharedStateUnavailable(
                    f"the shared store cannot be reached ({exc}): deleting now would not last; retry shortly",
                    headers={"Retry-After": "5"},
                ) from None
        with self.local.lock:
            if self.local.peek(key) is not None:
                self.local.pop(key)
                existed = True
        return existed

    def write_up(self) -> None:
        """Write to the shared store what was kept here alone while it was down (it runs when the store
        is back), so another instance continues each conversation from its latest turn."""
        for key in self.local.keys():
            copy = self.local.peek(key)
            if copy is not None and copy.shared is None:
                owner, _, record_id = key.partition("/")
                try:
                    self.put(owner, record_id, copy.value)
                except Exception:  # the store failed again (its link says so): the next return retries
                    log.exception("shared %s record %s not written up", self.shared.kind, record_id)
                    return

    def _local(self, key: str) -> V | None:
        copy = self.local.get(key)
        return copy.value if copy is not None else None

    def _not_shared(self, owner: str, record_id: str) -> V | None:
        """What to answer for a record the shared store does not hold: the copy written here while the
        store was down (written up now), else nothing — the copy of a record gone from it is dropped."""
        key = self._key(owner, record_id)
        with self.local.lock:
            copy = self.local.peek(key)
            if copy is None:
                return None
            if copy.shared is not None:
                self.local.pop(key)
                return None
        self.put(owner, record_id, copy.value)
        return copy.value
