"""Shared prompt heads' keys and values: the instruction of an embedding request (and a rerank's
instruction and query) computed once and copied into each input's cache — by the request's many inputs,
and by later requests with the same head, within one tenant's cache namespace.

A head is named by its token ids and the pictures in it: the keys and values of a token depend on the
tokens and pictures before it only, and the forward computes each row alone (service/model/forward.py),
so a head from here is the bits the input would have computed itself."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .. import metrics
from .lru import BudgetedLRU

# Heads are a few dozen tokens (~3 MiB each in bf16 on Qwen3-VL-2B): a small budget holds many.
MAX_BYTES = 64 * 2**20
MAX_ENTRIES = 256
TTL_SECONDS = 600.0


@dataclass(frozen=True)
class Head:
    """A prompt head's keys and values, layer by layer (1 × KV heads × tokens × head dim each)."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    tokens: int

    @classmethod
    def of(cls, cache, tokens: int) -> Head:
        """The first `tokens` positions of `cache` (a GrowingCache), copied."""
        return cls(
            tuple((layer.keys[:, :, :tokens].clone(), layer.values[:, :, :tokens].clone()) for layer in cache.layers),
            tokens,
        )

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def into(self, cache) -> None:
        """Write the head into an empty cache (which then holds its `tokens` positions)."""
        for layer, (keys, values) in zip(cache.layers, self.layers, strict=True):
            layer.update(keys, values)


def head_key(token_ids: list[int], media: list[str]) -> str:
    """A head's name: a digest of its token ids and the keys of the pictures and clips in it."""
    digest = hashlib.blake2b(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes(), digest_size=16)
    digest.update("\0".join(media).encode())
    return digest.hexdigest()


class PrefixCache:
    """Heads by name, within a request's cache namespace (its tenant and cache_salt)."""

    name = "prefix"

    def __init__(self, max_bytes: int = MAX_BYTES, max_entries: int = MAX_ENTRIES, ttl_seconds: float = TTL_SECONDS):
        self.entries: BudgetedLRU[Head] = BudgetedLRU(self.name, max_bytes, max_entries, ttl_seconds)

    def get(self, key: str, cache_namespace: str = "") -> Head | None:
        head = self.entries.get(f"{cache_namespace}:{key}") if self.entries.enabled else None
        (metrics.CACHE_HITS if head is not None else metrics.CACHE_MISSES).labels(cache=self.name).inc()
        return head

    def put(self, key: str, head: Head, cache_namespace: str = "") -> None:
        self.entries.put(f"{cache_namespace}:{key}", head, head.nbytes)
