"""Vision encoders: pixel patches → per-image features (`pooler_output` and deepstack features).

`VisionFeatures` is what the caches store and what the decoder's forward takes in
(service/model/forward.VisionRows: the pooled features replace the placeholders' embeddings, deepstack
feature k is added after decoder layer k).
Backends share one call: `encoder(pixel_values, image_grid_thw) -> list[VisionFeatures]`
(service/vision/encoders.py picks one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisionFeatures:
    """One image's encoder output: merged tokens × hidden, and one such tensor per deepstack layer."""

    pooler: torch.Tensor
    deepstack: list[torch.Tensor]

    @classmethod
    def cat(cls, parts: list[VisionFeatures]) -> VisionFeatures:
        """Several features (frames, pictures) as one, rows in order."""
        return cls(
            pooler=torch.cat([p.pooler for p in parts]),
            deepstack=[torch.cat(layer) for layer in zip(*(p.deepstack for p in parts))],
        )

    def rows(self, lo: int, hi: int) -> VisionFeatures:
        return VisionFeatures(pooler=self.pooler[lo:hi], deepstack=[d[lo:hi] for d in self.deepstack])


class TorchVisionEncoder:
    """The model's own vision tower (service/vision/tower.py)."""

    name = "torch"

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> list[VisionFeatures]:
        return self.model.model.visual.image_features(pixel_values, image_grid_thw)
