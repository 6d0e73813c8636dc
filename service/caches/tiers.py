"""The conversation cache's two tiers as one: memory (conversation.py) in front of disk (kv_disk/).

A kept cache goes to memory and, written behind, to disk; a lookup takes the longer of what the two
hold — memory when they hold as much, since it costs nothing to read — and a disk hit continues
exactly as a memory hit would: the same keys and values, bit for bit. A disk read that takes longer
than a share of what recomputing its tokens would cost is given up: the request recomputes.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from concurrent.futures import Future

import torch

from .. import metrics
from ..model.prompts import VisionSpan
from .conversation import ConversationCache, KVReuse
from .kv_disk import KVDiskStore

log = logging.getLogger(__name__)

MIN_READ_SECONDS = 1.0  # a disk read's deadline at least: a loaded machine's thread switches stay under it
# Prefill seconds per token until this instance has measured its own: 2B, INT8, 2 cores (30 s for 3,014 tokens).
ASSUMED_PREFILL_SECONDS_PER_TOKEN = 0.01


class ConversationTiers:
    def __init__(self, memory: ConversationCache, disk: KVDiskStore | None, read_timeout_share: float):
        self.memory = memory
        self.disk = disk
        self.read_timeout_share = read_timeout_share
        self._prefill_seconds_per_token = ASSUMED_PREFILL_SECONDS_PER_TOKEN

    def measured_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill computed `tokens` prompt tokens in `seconds` (its forwards only): what a disk
        read's deadline is measured against."""
        if tokens >= 64:  # shorter ones are mostly per-call overhead
            self._prefill_seconds_per_token = seconds / tokens

    def read_timeout(self, tokens: int) -> float:
        """Seconds a disk read of `tokens` tokens may take: KV_DISK_READ_TIMEOUT_SHARE of recomputing them."""
        return max(MIN_READ_SECONDS, self.read_timeout_share * tokens * self._prefill_seconds_per_token)

    def lookup(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        conversation_id: str | None,
        capacity: int,
        namespace: str = "",
        points: list[int] = (),
    ) -> Generator[Future, None, KVReuse | None]:
        """The cache of the longest reusable prefix of `token_ids` (at M-RoPE `positions`, 3 × tokens) in
        `namespace` (a request's cache_namespace: nothing of another is found), with room for `capacity`
        positions if it comes from disk; while the disk tier reads (on a thread of its own) this yields the
        read in progress, and the scheduler decodes its other sequences meanwhile; a read past its deadline
        counts as a miss.

        The disk is read only when it holds full blocks of the prompt (found by name, without
        reading: with none it holds nothing usable) beyond what memory holds — memory holds the
        latest turn of the conversations it has — so a new prompt never waits for the reader. A hybrid
        model's prefix from disk ends at one of `points` (the prompt's snapshot positions)."""
        in_memory = self.memory.reusable(token_ids, images, conversation_id, namespace)
        if self.disk is not None and self.disk.readable:
            limit = len(token_ids) - 1
            stored = self.disk.stored_blocks(token_ids, positions, images, limit, namespace)  # by name: hashes, stats
            blocks = stored[0]
            if not blocks and not in_memory:
                metrics.CACHE_MISSES.labels(cache=self.disk.name).inc()
            elif blocks and blocks[-1].end > in_memory:
                timeout = self.read_timeout(blocks[-1].end - in_memory)
                reading = self.disk.read_async(
                    token_ids, positions, images, limit, capacity, in_memory, stored, timeout, points, namespace
                )
                while not reading.done():
                    yield reading
                try:
                    reuse = reading.result()
                except TimeoutError as exc:
                    log.warning(
                        "KV disk tier: a read of %d tokens gave up (%s); they are recomputed", blocks[-1].end, exc
                    )
                    metrics.KV_DISK_READ_TIMEOUTS.inc()
                    metrics.CACHE_MISSES.labels(cache=self.disk.name).inc()
                    reuse = None
                except Exception:
                    log.exception("KV disk tier: reading a prefix failed")
                    reuse = None
                if reuse is not None:
                    metrics.CACHE_MISSES.labels(cache=self.memory.name).inc()
                    metrics.CACHE_REUSED_TOKENS.inc(reuse.tokens)
                    return reuse
        reuse = self.memory.take(token_ids, images, conversation_id, namespace)
        if reuse is not None and self.disk is not None:
            self.disk.truncate(reuse.cache, reuse.tokens)  # extended in place from there on: not written past it
        return reuse

    def keep(
        self,
        conversation_id: str | None,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        images: list[VisionSpan],
        prompt_tokens: int,
        cache,
        namespace: str = "",
    ) -> None:
        """Keep a finished generation's cache (covering `token_ids`, at M-RoPE `positions`) in memory
        and, behind, on disk, in `namespace`."""
        self.memory.put(conversation_id, token_ids, images, prompt_tokens, cache, namespace)
        if self.disk is not None:
            self.disk.save(cache, token_ids.clone(), positions.clone(), images, namespace)
