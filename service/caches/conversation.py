"""The conversation cache: the KV caches of finished generations, a byte-budgeted LRU with an idle
TTL and an entry cap (lru.py).

`ConversationCache` keeps each KV cache (`DynamicCache`) with the exact token ids it covers and the
images inside them; a new prompt reuses the longest prefix any entry shares with it.

Every entry belongs to a cache namespace (a request's `cache_namespace`: its tenant and cache_salt, an
opaque keyed hash; "" without keys and salt): a request matches only its own namespace's entries, so
what one tenant sent never shortens another's prefill (cached_tokens, the first token's time).

Nothing handed out is ever still in a cache: a reused KV cache is either taken out of the cache
(the request then owns and extends it, and stores it back when done) or is a copy of the shared
prefix, so eviction and later requests never touch a generation in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .. import metrics
from ..model.hybrid import HybridCache
from ..model.kv import GrowingCache, compacted
from ..model.prompts import VisionSpan
from .lru import BudgetedLRU, tensor_bytes


def kv_bytes(cache: DynamicCache | HybridCache) -> int:
    """What a kept cache holds: its keys and values (and a hybrid model's states and snapshots)."""
    if isinstance(cache, HybridCache):
        return cache.nbytes()
    return tensor_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))


# -- conversation KV cache ---------------------------------------------------------------------


@dataclass
class KVEntry:
    token_ids: torch.Tensor  # 1-D: exactly the tokens `cache` holds keys and values for
    images: list[VisionSpan]
    prompt_tokens: int  # the prompt of the generation that made it (the rest is its answer)
    conversation_id: str | None
    cache: DynamicCache
    namespace: str = ""


@dataclass
class KVReuse:
    """A KV cache for a request to continue from, holding exactly its first `tokens` prompt tokens.
    The request owns it (its prefill and decode steps extend it in place)."""

    cache: DynamicCache
    tokens: int
    source: str = "memory"  # the tier it came from: memory, or disk (service/caches/kv_disk/)


def reusable_prefix(entry: KVEntry, token_ids: torch.Tensor, images: list[VisionSpan]) -> int:
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
            n = start
            break
    # a hybrid model's recurrent state resumes only where the entry kept it (a snapshot, or its end)
    return entry.cache.resumable(n) if isinstance(entry.cache, HybridCache) else n


def copy_prefix(cache: DynamicCache | HybridCache, tokens: int, config) -> DynamicCache | HybridCache:
    """A new cache holding the first `tokens` positions of `cache` (its own memory)."""
    if isinstance(cache, HybridCache):
        return cache.prefix(tokens)
    return GrowingCache(
        ddp_cache_data=[
            (layer.keys[..., :tokens, :].clone(), layer.values[..., :tokens, :].clone()) for layer in cache.layers
        ],
        config=config,
    )


class ConversationCache:
    """KV caches of finished generations; see the module docstring.

    One entry per `conversation_id` within a namespace (a new turn replaces its conversation's entry);
    requests without one get entries of their own. Any request may reuse any entry of its namespace:
    stateless clients resend their history and are matched by the longest common prefix.
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

    def _best(self, token_ids: torch.Tensor, images: list[VisionSpan], conversation_id: str | None, namespace: str):
        """(key, tokens) of the namespace's entry holding the longest reusable prefix, or (None, 0)."""
        best_key, best = None, 0
        for key in reversed(self.entries.keys()):  # most recent first: it wins ties
            entry = self.entries.peek(key)
            if entry.namespace != namespace:
                continue
            n = reusable_prefix(entry, token_ids, images)
            same = conversation_id is not None and entry.conversation_id == conversation_id
            if n > best or (n == best and n > 0 and same):
                best_key, best = key, n
        return (best_key, best) if best >= self.min_tokens else (None, 0)

    def reusable(
        self, token_ids: torch.Tensor, images: list[VisionSpan], conversation_id: str | None, namespace: str = ""
    ) -> int:
        """How many tokens `take` would give now (0: a miss); takes nothing."""
        if not self.enabled:
            return 0
        with self.entries.lock:
            self.entries.sweep()
            return self._best(token_ids, images, conversation_id, namespace)[1]

    def take(
        self, token_ids: torch.Tensor, images: list[VisionSpan], conversation_id: str | None, namespace: str = ""
    ) -> KVReuse | None:
        """The KV cache of the longest reusable prefix of `token_ids` (1-D), or None on a miss.

        The entry itself is handed over (no copy) when this request supersedes it — it continues the
        entry's own answer, or it is the same conversation — and cropped to the prefix; otherwise the
        prefix is copied and the entry stays for its own conversation.
        """
        if not self.enabled:
            return None
        with self.entries.lock:
            self.entries.sweep()
            best_key, best = self._best(token_ids, images, conversation_id, namespace)
            if best_key is None:
                metrics.CACHE_MISSES.labels(cache=self.name).inc()
                return None
            entry = self.entries.peek(best_key)
            supersedes = best >= entry.prompt_tokens or (
                conversation_id is not None and entry.conversation_id == conversation_id
            )
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

    def put(
        self,
        conversation_id: str | None,
        token_ids: torch.Tensor,
        images: list[VisionSpan],
        prompt_tokens: int,
        cache: DynamicCache,
        namespace: str = "",
    ) -> bool:
        """Keep a finished generation's cache, in `namespace`; `token_ids` are the tokens it covers."""
        if not self.enabled:
            return False
        length = cache.get_seq_length()
        if length != len(token_ids):
            raise ValueError(f"the cache holds {length} tokens, the ids given are {len(token_ids)}")
        entry = KVEntry(
            token_ids=token_ids.clone(),
            images=[s for s in images if s.end <= length],
            prompt_tokens=prompt_tokens,
            conversation_id=conversation_id,
            cache=cache,
            namespace=namespace,
        )
        if conversation_id is None:
            key = f"anon:{next(self._anonymous)}"
        else:  # an id holds no '/': a namespace's keys never meet the keys of none
            key = f"id:{namespace}/{conversation_id}" if namespace else f"id:{conversation_id}"
        return self.entries.put(key, entry, kv_bytes(compacted(cache)))  # kept, not extended: no spare room
