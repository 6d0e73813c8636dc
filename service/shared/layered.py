"""A store of one kind of record that many instances share: the shared records (records.py) are the
truth where there are any, and this instance keeps a copy of what it wrote or read, bounded like today's
stores, to serve from while they cannot be reached. Without a shared store it is that copy alone, as
before.

Each copy knows the shared version it is. A change to a record (`update`) is made on its current value and
written only if the store still holds the version it was made from — else made again on the newer one —
and one instance's threads change a record one at a time: two turns added at once, here or on two
machines, are both kept. What is written while the shared store is down is kept here, marked with the
version it was made from, and goes up when the store is back (`write_up`, or when it is read here first)
only if the store still holds that version: where another instance changed the record meanwhile (a turn
of its own) or it is gone (expired, evicted, deleted), the store's word is kept and this copy dropped —
logged and counted (`qwen3vl_shared_state_conflicts_total`). A delete needs the shared store (503 while
it is down): done on one instance alone, the record would come back from the store."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .. import metrics
from ..caches.lru import BudgetedLRU
from ..errors import SharedStateUnavailable
from .codec import RecordCorrupt
from .link import SharedUnavailable
from .pictures import PictureMismatch
from .records import ABSENT, SharedRecords, VersionConflict

log = logging.getLogger("service.shared")
V = TypeVar("V")

LOCK_STRIPES = 64  # an instance's threads change a record one at a time (records share a lock by hash)
UPDATE_ATTEMPTS = 32  # a change made again on a newer value at most this often (other instances' changes)


@dataclass(frozen=True)
class _Copy(Generic[V]):
    value: V
    version: int  # the shared store's version this is; `dirty`: the one it was made from (ABSENT: none)
    dirty: bool = False  # made here while the shared store could not be reached: not written there yet


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
        self._locks = [threading.RLock() for _ in range(LOCK_STRIPES)]
        if shared is not None:
            shared.link.on_back.append(self.write_up)
            metrics.SHARED_STATE_CONFLICTS.labels(shared.kind)  # at zero from the start

    @staticmethod
    def _key(owner: str, record_id: str) -> str:
        return f"{owner}/{record_id}"

    def _lock(self, key: str) -> threading.RLock:
        return self._locks[hash(key) % LOCK_STRIPES]

    def get(self, owner: str, record_id: str) -> V | None:
        """The value, or None (unknown, expired, evicted or deleted, or another owner's: alike)."""
        with self._lock(self._key(owner, record_id)):
            return self._current(owner, record_id)[0]

    def put(self, owner: str, record_id: str, value: V) -> None:
        """Keep it here and, where there is a shared store, there (here alone while it is down), whatever
        the store held: for a new record, or one only its own conversation's turns replace."""
        key = self._key(owner, record_id)
        with self._lock(key):
            held = self.local.peek(key)
            self._write(owner, record_id, value, None, held.version if held is not None else ABSENT)

    def update(self, owner: str, record_id: str, change: Callable[[V], V]) -> V | None:
        """Change a record in one step and return its new value: `change(current)`, written only if nobody
        changed the record meanwhile — this instance's other threads wait, and a change from another
        instance first means it is made again on the newer value. None (nothing changed) for a record not
        here. `change` may raise (a 4xx) to leave the record as it is."""
        key = self._key(owner, record_id)
        with self._lock(key):
            for _ in range(UPDATE_ATTEMPTS):
                current, version = self._current(owner, record_id)
                if current is None:
                    return None
                changed = change(current)
                try:
                    self._write(owner, record_id, changed, version, version)
                except VersionConflict:
                    continue  # another instance's change came first: made again on it
                return changed
        raise SharedStateUnavailable(
            f"the {self.shared.kind} record changed {UPDATE_ATTEMPTS} times while this change was made: retry",
            headers={"Retry-After": "1"},
        )

    def keep_here(self, owner: str, record_id: str, value: V) -> None:
        """Keep a copy here alone (found in another store of this machine's: a disk copy)."""
        self.local.put(self._key(owner, record_id), _Copy(value, ABSENT, dirty=True), self._size_of(value))

    def delete(self, owner: str, record_id: str) -> bool:
        """Forget it everywhere; False if nobody held it. SharedStateUnavailable (503) while the shared
        store is down: a delete made here alone would be undone by the store when it is back."""
        key = self._key(owner, record_id)
        existed = False
        with self._lock(key):
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
        is back), where the store still holds what it was made from (see the module docstring)."""
        for key in self.local.keys():
            if not self.shared.link.usable():
                return  # the store failed again: its next return tries again
            owner, _, record_id = key.partition("/")
            with self._lock(key):
                copy = self.local.peek(key)
                if copy is not None and copy.dirty:
                    self._write_up(owner, record_id, copy)

    def _current(self, owner: str, record_id: str) -> tuple[V | None, int]:
        """The value (or None) and the shared version it is — while the store is down, this instance's copy
        and the version it is or was made from. A copy made here while the store was down is written up
        first where the store still holds what it was made from, else dropped for the store's."""
        key = self._key(owner, record_id)
        if self.shared is None:
            copy = self.local.get(key)
            return (copy.value, ABSENT) if copy is not None else (None, ABSENT)
        try:
            made_here = self.local.peek(key)
            if made_here is not None and made_here.dirty:
                self._write_up(owner, record_id, made_here)
            found = self.shared.read(owner, record_id)
        except SharedUnavailable:
            copy = self.local.get(key)
            return (copy.value, copy.version) if copy is not None else (None, ABSENT)
        copy = self.local.get(key)
        if found is None:
            if copy is not None and copy.dirty:
                return copy.value, copy.version  # too large for the store: kept here alone
            if copy is not None:
                self._drop(key, copy)  # expired, evicted or deleted there: never brought back
            return None, ABSENT
        blob, version = found
        if copy is not None and copy.version == version and not copy.dirty:
            return copy.value, version  # the copy is what the store holds: no decoding
        try:
            value = self._from_blob(blob)
        except (RecordCorrupt, PictureMismatch, KeyError, TypeError, ValueError) as exc:
            log.error("shared %s record %s unreadable (%s): treated as gone", self.shared.kind, record_id, exc)
            return None, ABSENT
        self.local.put(key, _Copy(value, version), self._size_of(value))
        return value, version

    def _write(self, owner: str, record_id: str, value: V, based_on: int | None, made_from: int) -> None:
        """Write `value` there — where given, only if the store holds version `based_on` (VersionConflict
        else) — and keep it here; while the store cannot be reached, here alone, marked as made from
        version `made_from`."""
        key = self._key(owner, record_id)
        size = self._size_of(value)
        if self.shared is None:
            self.local.put(key, _Copy(value, ABSENT), size)
            return
        try:
            version = self.shared.put(owner, record_id, self._to_blob(value), based_on)
        except SharedUnavailable:
            self.local.put(key, _Copy(value, made_from, dirty=True), size)
            return
        # Version 0: too large for the store's bytes, kept here alone (as while it is down).
        self.local.put(key, _Copy(value, version, dirty=not version), size)

    def _write_up(self, owner: str, record_id: str, copy: _Copy[V]) -> None:
        """A copy made here while the store was down, written there if the store still holds the version it
        was made from; else (another instance changed the record meanwhile, or it is gone there) the store's
        word kept and this copy dropped, logged and counted."""
        try:
            self._write(owner, record_id, copy.value, copy.version, copy.version)
        except VersionConflict:
            kind = self.shared.kind
            log.warning(
                "shared %s record %s changed elsewhere (or gone) while this instance could not reach the store: "
                "its copy made from version %d, changed here meanwhile, is dropped for the store's",
                kind,
                record_id,
                copy.version,
            )
            metrics.SHARED_STATE_CONFLICTS.labels(kind).inc()
            self._drop(self._key(owner, record_id), copy)

    def _drop(self, key: str, copy: _Copy[V]) -> None:
        with self.local.lock:
            if self.local.peek(key) is copy:
                self.local.pop(key)
