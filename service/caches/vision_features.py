"""The vision-feature cache: each image's encoder output, kept by what makes it (pixels, grid,
processor settings, encoder), so a picture seen before skips the vision tower."""

from __future__ import annotations

import torch

from .. import metrics
from ..vision.features import VisionFeatures
from .lru import BudgetedLRU, tensor_bytes


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
