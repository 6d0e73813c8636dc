"""The caches as the settings and the memory budget make them: the conversation KV cache (memory,
and its disk tier) and the vision-feature cache, their budgets published as metrics."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass

import torch

from .. import metrics
from ..memory import CONVERSATION_CACHE_SHARE, MIB, VISION_CACHE_SHARE, MemoryGuard
from ..model.identity import checkpoint_identity
from ..settings import Settings
from .conversation import ConversationCache
from .kv_disk import KVDiskStore, KVLayout, default_budget_bytes, held_bytes
from .tiers import ConversationTiers
from .vision_features import VisionFeatureCache, vision_settings

log = logging.getLogger(__name__)


@dataclass
class Caches:
    """What an engine reuses across requests: `kv` (the conversation KV cache's tiers) and `vision`."""

    kv: ConversationTiers
    vision: VisionFeatureCache

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        loaded,
        memory: MemoryGuard,
        vision_encoder_name: str,
        kv_dtype: torch.dtype,
        head: bool = False,
    ) -> Caches:
        """The caches for `loaded` (a LoadedModel), sized from what the memory budget leaves after
        loading; near the budget they give memory back (KV first: the largest). `head`: sequences keep
        a multi-token prediction head's keys and values too, which the disk tier stores beside theirs."""
        kv_bytes, vision_bytes = _budgets(settings, memory)
        config, encoder_input = loaded.model.config, vision_settings(loaded.processor.image_processor)
        memory_tier = ConversationCache(
            config, kv_bytes, settings.conversation_cache_max_entries, settings.cache_ttl_seconds
        )
        vision = VisionFeatureCache(
            vision_bytes,
            settings.vision_cache_max_entries,
            settings.cache_ttl_seconds,
            namespace=f"{vision_encoder_name}:{encoder_input}",
        )
        memory.evict_callbacks += [memory_tier.entries.shrink, vision.entries.shrink]
        metrics.MEMORY_BUDGET.set(memory.budget_bytes or 0)
        metrics.show_cache(memory_tier.name, kv_bytes)
        metrics.show_cache(vision.name, vision_bytes)
        disk = _kv_disk(settings, loaded, vision_encoder_name, encoder_input, KVLayout.of(config, kv_dtype, int(head)))
        return cls(ConversationTiers(memory_tier, disk, settings.kv_disk_read_timeout_share), vision)


def _budgets(settings: Settings, memory: MemoryGuard) -> tuple[int, int]:
    """The caches' byte budgets: as set, or shares of what the memory budget leaves after loading."""
    if not settings.cache_enabled:
        return 0, 0
    room = memory.room_bytes()
    kv = settings.conversation_cache_max_bytes
    vision = settings.vision_cache_max_bytes
    kv = int(room * CONVERSATION_CACHE_SHARE) if kv is None else kv
    vision = int(room * VISION_CACHE_SHARE) if vision is None else vision
    log.info(
        "memory budget %.0f MiB, %.0f MiB used after loading: conversation cache up to %.0f MiB, vision "
        "cache up to %.0f MiB",
        memory.budget_bytes / MIB,
        memory.used_bytes() / MIB,
        kv / MIB,
        vision / MIB,
    )
    return kv, vision


def _kv_disk(settings: Settings, loaded, encoder: str, encoder_input: str, layout: KVLayout) -> KVDiskStore | None:
    """The conversation cache's disk tier (KV_DISK_MB; off with the caches), its files named for
    exactly this checkpoint, quantization, vision encoder and KV layout; None (one warning, the
    qwen3vl_kv_disk_usable gauge at 0) when its folder cannot be used: an optional cache never stops
    the model from serving."""
    if not settings.cache_enabled or settings.kv_disk_mb == 0:
        return None
    root = settings.kv_disk_dir or settings.cache_dir / "kv"
    parts = [
        checkpoint_identity(loaded.path),
        loaded.quantization,
        loaded.weights_mapped,  # mapped INT8 weights compute prompts another way: other bits
        encoder,
        encoder_input,
        layout.described(),
    ]
    fingerprint = hashlib.blake2b(json.dumps(parts).encode(), digest_size=16).hexdigest()
    try:
        held = held_bytes(root)
        budget = settings.kv_disk_mb * MIB if settings.kv_disk_mb else default_budget_bytes(root, held)
        store = KVDiskStore(root, budget, fingerprint, layout, loaded.model.config)
    except OSError as exc:
        metrics.KV_DISK_USABLE.set(0)
        log.warning(
            "KV disk tier off: KV_DISK_DIR %s is unusable (%s); conversations are kept in memory only", root, exc
        )
        return None
    metrics.show_cache(store.name, store.budget_bytes)
    log.info("conversation cache on disk: %s, up to %.0f MiB (%.0f MiB held now)", root, budget / MIB, held / MIB)
    return store
