"""A byte-budgeted LRU with an idle TTL and an entry cap, counting its evictions in /metrics: the
engine's caches and the native endpoint's conversation histories are built on it."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

from .. import metrics

V = TypeVar("V")


@dataclass
class _Slot(Generic[V]):
    value: V
    nbytes: int
    last_used: float


class BudgetedLRU(Generic[V]):
    """key → value, least recently used first out, bounded by bytes, entries and idle seconds.

    `max_bytes == 0` or `max_entries == 0` disables the cache: it holds and counts nothing.
    Thread-safe; expired entries go at every access and, while any are held, from a sweeper thread.
    """

    def __init__(self, name: str, max_bytes: int, max_entries: int, ttl_seconds: float):
        self.name = name
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._slots: OrderedDict[str, _Slot[V]] = OrderedDict()
        self._bytes = 0
        self.lock = threading.RLock()  # hold it to make several calls one atomic step
        self._sweeper: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and self.max_entries > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[str]:
        """Keys, least recently used first."""
        with self.lock:
            return list(self._slots)

    def peek(self, key: str) -> V | None:
        """The value, leaving its place in the LRU order as it is."""
        slot = self._slots.get(key)
        return slot.value if slot else None

    def get(self, key: str) -> V | None:
        """The value (now most recently used), or None."""
        with self.lock:
            self.sweep()
            slot = self._slots.get(key)
            if slot is None:
                return None
            slot.last_used = time.monotonic()
            self._slots.move_to_end(key)
            return slot.value

    def put(self, key: str, value: V, nbytes: int) -> bool:
        """Store (replacing `key`), then evict least recently used entries until within bounds.
        False when the cache is off or the value alone exceeds the byte budget."""
        if not self.enabled:
            return False
        with self.lock:
            self.sweep()
            if key in self._slots:
                self._remove(key, "replaced")
            if nbytes > self.max_bytes:
                metrics.CACHE_EVICTIONS.labels(cache=self.name, reason="too_large").inc()
                return False
            self._slots[key] = _Slot(value, nbytes, time.monotonic())
            self._bytes += nbytes
            metrics.CACHE_BYTES.labels(cache=self.name).inc(nbytes)
            metrics.CACHE_ENTRIES.labels(cache=self.name).inc()
            while self._bytes > self.max_bytes or len(self._slots) > self.max_entries:
                oldest = next(iter(self._slots))
                self._remove(oldest, "bytes" if self._bytes > self.max_bytes else "entries")
            self._start_sweeper()
            return True

    def pop(self, key: str) -> V:
        """Take the value out of the cache (the caller owns it now)."""
        with self.lock:
            return self._remove(key, None).value

    def shrink(self, bytes_wanted: int, reason: str = "memory") -> int:
        """Evict least recently used entries until `bytes_wanted` are freed (or none is left);
        the bytes freed. For a memory budget that spans several caches."""
        freed = 0
        with self.lock:
            while self._slots and freed < bytes_wanted:
                freed += self._remove(next(iter(self._slots)), reason).nbytes
        return freed

    def sweep(self) -> None:
        """Drop entries idle for longer than the TTL."""
        with self.lock:
            cutoff = time.monotonic() - self.ttl_seconds
            for key in [k for k, s in self._slots.items() if s.last_used < cutoff]:
                self._remove(key, "ttl")

    def clear(self) -> None:
        with self.lock:
            for key in list(self._slots):
                self._remove(key, "cleared")

    def _remove(self, key: str, reason: str | None) -> _Slot[V]:
        slot = self._slots.pop(key)
        self._bytes -= slot.nbytes
        metrics.CACHE_BYTES.labels(cache=self.name).dec(slot.nbytes)
        metrics.CACHE_ENTRIES.labels(cache=self.name).dec()
        if reason is not None:
            metrics.CACHE_EVICTIONS.labels(cache=self.name, reason=reason).inc()
        return slot

    def _start_sweeper(self) -> None:
        # Started on first use, i.e. in the process that serves (threads do not survive a fork).
        if self._sweeper is None or not self._sweeper.is_alive():
            self._sweeper = threading.Thread(target=self._sweep_while_held, name=f"{self.name}-cache-ttl", daemon=True)
            self._sweeper.start()

    def _sweep_while_held(self) -> None:
        interval = min(60.0, max(self.ttl_seconds / 4, 0.05))
        while self._slots:
            time.sleep(interval)
            self.sweep()


def tensor_bytes(tensors) -> int:
    """Bytes the tensors hold in memory (their storages, which a view may keep larger than itself)."""
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)
