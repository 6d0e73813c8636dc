"""The vision-feature cache: each image's encoder output, kept by what makes it (pixels, grid,
processor settings, encoder), so a picture seen before skips the vision tower."""

from __future__ import annotations

import hashlib

import torch

from .. import metrics
from ..vision.features import VisionFeatures
from .lru import BudgetedLRU, tensor_bytes


def _compact(t: torch.Tensor) -> torch.Tensor:
    """The tensor alone in its own storage (a slice of a batch output would pin the whole batch)."""
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def vision_settings(ip) -> str:
    """A digest of everything besides the pixels that shapes the vision encoder's input (part of every
    key of a cache of what the encoder made)."""
    settings = (ip.patch_size, ip.merge_size, ip.temporal_patch_size, list(ip.image_mean), list(ip.image_std))
    return hashlib.blake2b(repr((*settings, dict(ip.size))).encode(), digest_size=8).hexdigest()


class VisionFeatureCache:
    """Vision-encoder outputs per picture, by its span's key (pixels and grid) within `namespace`
    (the encoder backend and the processor settings), so a hit gives exactly what the encoder would;
    and within a request's `cache_namespace` (its tenant and cache_salt), so a tenant never learns
    from a hit that another sent the picture."""

    name = "vision"

    def __init__(self, max_bytes: int, max_entries: int, ttl_seconds: float, namespace: str = ""):
        self.entries: BudgetedLRU[VisionFeatures] = BudgetedLRU(self.name, max_bytes, max_entries, ttl_seconds)
        self.namespace = namespace

    @property
    def enabled(self) -> bool:
        return self.entries.enabled

    def get(self, key: str, cache_namespace: str = "") -> VisionFeatures | None:
        if not self.enabled:
            return None
        features = self.entries.get(f"{self.namespace}:{cache_namespace}:{key}")
        (metrics.CACHE_HITS if features is not None else metrics.CACHE_MISSES).labels(cache=self.name).inc()
        return features

    def put(self, key: str, features: VisionFeatures, cache_namespace: str = "") -> bool:
        if not self.enabled:
            return False
        features = VisionFeatures(pooler=_compact(features.pooler), deepstack=[_compact(t) for t in features.deepstack])
        return self.entries.put(
            f"{self.namespace}:{cache_namespace}:{key}", features, tensor_bytes((features.pooler, *features.deepstack))
        )
