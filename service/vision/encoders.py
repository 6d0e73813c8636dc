"""The vision encoder VISION_BACKEND names: the model's own tower, or its ONNX Runtime export."""

from __future__ import annotations

from .features import TorchVisionEncoder
from .onnx import load_onnx_encoder


def make_vision_encoder(loaded, settings):
    """The encoder VISION_BACKEND names for this checkpoint. `onnxruntime` needs an export made
    beforehand (`python -m service export-onnx`); without a current one it warns and uses torch."""
    if settings.vision_backend == "onnxruntime":
        encoder = load_onnx_encoder(loaded.path, settings)
        if encoder is not None:
            return encoder
    return TorchVisionEncoder(loaded.model)
