"""A checkpoint's safetensors read a tensor at a time, or some rows of one (`SourceTensors`): how the
quantized checkpoint writer (service/quant/writer.py) reads a checkpoint on disk. Random weights
offer the same reads (service/random_checkpoints/random_weights.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import published


class SourceTensors:
    """Per-tensor reads from a checkpoint's safetensors; files are opened per call, so the pages
    read are unmapped (and leave RSS) as soon as the caller drops the tensors."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path} has no safetensors weights")
            self.file_of = {}
            for file in files:
                with safe_open(file, "pt") as f:
                    self.file_of.update(dict.fromkeys(f.keys(), file.name))
        self.path = path
        self.published = published.quantized_linears(self.file_of)  # GPTQ/AWQ 4-bit Linears

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.path / self.file_of[name], "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in set(self.file_of.values()))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor (along its first dimension), read alone."""
        from safetensors import safe_open

        with safe_open(self.path / self.file_of[name], "pt") as f:
            return f.get_slice(name)[start:stop]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        missing = [n for n in names if n not in self.file_of]
        if missing:
            raise KeyError(f"{self.path} lacks tensors {missing[:3]}: is it a Qwen3-VL checkpoint?")
        out = {}
        for file in sorted({self.file_of[n] for n in names}):
            with safe_open(self.path / file, "pt") as f:
                for n in names:
                    if self.file_of[n] == file:
                        out[n] = f.get_tensor(n)
        return out
