"""The engine's two caches, each a byte-budgeted LRU with an idle TTL and an entry cap.

`ConversationCache` keeps the KV cache (`DynamicCache`) of finished generations with the exact
token ids it covers and the images inside them; a new prompt reuses the longest prefix any entry
shares with it. `VisionFeatureCache` keeps vision-encoder outputs per image.

Nothing handed out is ever still in a cache: a reused KV cache is either taken out of the cache
(the request then owns and extends it, and stores it back when done) or is a copy of the shared
prefix, so eviction and later requests never touch a generation in flight.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from transformers import DynamicCache

from . import metrics
from .kv import GrowingCache, compacted
from .vision import VisionFeatures

V = TypeVar("V")


def tensor_bytes(tensors) -> int:
    """Bytes the tensors hold in memory (their storages, which a view may keep larger than itself)."""
    return sum(t.untyped_storage().nbytes() for t in tensors if t is not None)


def kv_bytes(cache: DynamicCache) -> int:
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))


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
            self._sweeper = threading.Thread(target=self._sweep_while_held, name=f"{self.name}-cache-ttl",
                                             daemon=True)
            self._sweeper.start()

    def _sweep_while_held(self) -> None:
        interval = min(60.0, max(self.ttl_seconds / 4, 0.05))
        while self._slots:
            time.sleep(interval)
            self.sweep()


# -- conversation KV cache ---------------------------------------------------------------------


@dataclass(frozen=True)
class ImageSpan:
    """An image inside a token sequence: [start, end) from <|vision_start|> to <|vision_end|>, and
    an identity of its pixels and grid (same tokens with another picture behind them differ here)."""

    start: int
    end: int
    key: str


@dataclass
class KVEntry:
    token_ids: torch.Tensor  # 1-D: exactly the tokens `cache` holds keys and values for
    images: list[ImageSpan]
    prompt_tokens: int  # the prompt of the generation that made it (the rest is its answer)
    conversation_id: str | None
    cache: DynamicCache


@dataclass
class KVReuse:
    """A KV cache for a request to continue from, holding exactly its first `tokens` prompt tokens.
    The request owns it (its prefill and decode steps extend it in place)."""

    cache: DynamicCache
    tokens: int


def reusable_prefix(entry: KVEntry, token_ids: torch.Tensor, images: list[ImageSpan]) -> int:
    """How many leading tokens of `token_ids` the entry's cache holds exactly: the common token
    prefix, cut back to before the first image whose picture differs or that it would split, and
    leaving at least one token to compute (the forward that gives the first logits needs one)."""
    limit = min(len(entry.token_ids), len(token_ids) - 1)
    if limit <= 0:
        return 0
    differ = (entry.token_ids[:limit] != token_ids[:limit]).nonzero()
    n = int(differ[0]) if len(differ) else limit
    mine = {(s.start, s.end): s.key for s in entry.images}
    theirs = {(s.start, s.end): s.key for s in images}
    for start, end in sorted({*mine, *theirs}):
        if start >= n:
            break
        if end > n or mine.get((start, end)) != theirs.get((start, end)):
            return start
    return n


def copy_prefix(cache: DynamicCache, tokens: int, config) -> DynamicCache:
    """A new cache holding the first `tokens` positions of `cache` (its own memory)."""
    return GrowingCache(ddp_cache_data=[(layer.keys[..., :tokens, :].clone(), layer.values[..., :tokens, :].clone())
                                        for layer in cache.layers], config=config)


class ConversationCache:
    """KV caches of finished generations; see the module docstring.

    One entry per `conversation_id` (a new turn replaces its conversation's entry); requests without
    one get entries of their own. Any request may reuse any entry: stateless clients resend their
    history and are matched by the longest common prefix.
    """

    name = "conversation"

    def __init__(self, model_config, max_bytes: int, max_entries: int, ttl_seconds: float, min_tokens: int = 16):
        self.model_config = model_config
        # A few shared tokens (the chat template's opening) save next to nothing: not counted as a hit.
        self.min_tokens = min_tokens
        self.entries: BudgetedLRU[KVEntry] = BudgetedLRU(self.name, max_bytes, max_entries, ttl_seconds)
        self._anonymous = itertools.count()

    @property
    def enabled(self) -> bool:
        return self.entries.enabled

    def take(self, token_ids: torch.Tensor, images: list[ImageSpan], conversation_id: str | None) -> KVReuse | None:
        """The KV cache of the longest reusable prefix of `token_ids` (1-D), or None on a miss.

        The entry itself is handed over (no copy) when this request supersedes it — it continues the
        entry's own answer, or it is the same conversation — and cropped to the prefix; otherwise the
        prefix is copied and the entry stays for its own conversation.
        """
        if not self.enabled:
            return None
        with self.entries.lock:
            self.entries.sweep()
            best_key, best = None, 0
            for key in reversed(self.entries.keys()):  # most recent first: it wins ties
                entry = self.entries.peek(key)
                n = reusable_prefix(entry, token_ids, images)
                same = conversation_id is not None and entry.conversation_id == conversation_id
                if n > best or (n == best and n > 0 and same):
                    best_key, best = key, n
            if best_key is None or best < self.min_tokens:
                metrics.CACHE_MISSES.labels(cache=self.name).inc()
                return None
            entry = self.entries.peek(best_key)
            supersedes = best >= entry.prompt_tokens or (
                conversation_id is not None and entry.conversation_id == conversation_id)
            if supersedes:
                self.entries.pop(best_key)
                cache = entry.cache
                cache.crop(best - cache.get_seq_length())
            else:
                self.entries.get(best_key)  # now the most recently used
                cache = copy_prefix(entry.cache, best, self.model_config)
        metrics.CACHE_HITS.labels(cache=self.name).inc()
        metrics.CACHE_REUSED_TOKENS.inc(best)
        return KVReuse(cache=cache, tokens=best)

    def put(self, conversation_id: str | None, token_ids: torch.Tensor, images: list[ImageSpan],
            prompt_tokens: int, cache: DynamicCache) -> bool:
        """Keep a finished generation's cache; `token_ids` are the tokens it covers."""
        if not self.enabled:
            return False
        length = cache.get_seq_length()
        if length != len(token_ids):
            raise ValueError(f"the cache holds {length} tokens, the ids given are {len(token_ids)}")
        entry = KVEntry(token_ids=token_ids.clone(), images=[s for s in images if s.end <= length],
                        prompt_tokens=prompt_tokens, conversation_id=conversation_id, cache=cache)
        key = f"id:{conversation_id}" if conversation_id is not None else f"anon:{next(self._anonymous)}"
        return self.entries.put(key, entry, kv_bytes(compacted(cache)))  # kept, not extended: no spare room


# -- vision features ---------------------------------------------------------------------------


def _compact(t: torch.Tensor) -> torch.Tensor:
    """The tensor alone in its own storage (a slice of a batch output would pin the whole batch)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class VisionFeatureCache:
    """Vision-encoder outputs per image; the key (see `Engine`) names the pixels, the processor
    settings and the encoder backend, so a hit gives exactly what the encoder would."""

    name = "vision"

    def __init__(self, max_bytes: int, max_entries: int, ttl_seconds: float):
        self.entries: BudgetedLRU[VisionFeatures] = BudgetedLRU(self.name, max_bytes, max_entries, ttl_seconds)

    @property
    def enabled(self) -> bool:
        return self.entries.enabled

    def get(self, key: str) -> VisionFeatures | None:
        if not self.enabled:
            return None
        features = self.entries.get(key)
        (metrics.CACHE_HITS if features is not None else metrics.CACHE_MISSES).labels(cache=self.name).inc()
        return features

    def put(self, key: str, features: VisionFeatures) -> bool:
        if not self.enabled:
            return False
        features = VisionFeatures(pooler=_compact(features.pooler), deepstack=[_compact(t) for t in features.deepstack])
        return self.entries.put(key, features, tensor_bytes((features.pooler, *features.deepstack)))
