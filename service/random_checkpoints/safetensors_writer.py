"""Hugging Face safetensors shards of a random checkpoint (`make-model` without `--bits`), each tensor
generated and written in pieces, so memory stays a piece whatever the model's size.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from ..quant.packing import DTYPE_NAMES

SHARD_BYTES = 2 * 1024**3


def write_safetensors(source, out_dir: Path, shard_bytes: int = SHARD_BYTES, progress: bool = False) -> None:
    """`source`'s tensors into Hugging Face safetensors shards (model.safetensors, or model-0000i-of-N
    and their index), each tensor generated and written in pieces of at most ~64 MB: memory stays
    that, whatever the model's size."""
    from tqdm import tqdm

    names = sorted(source.shapes)
    size = {n: math.prod(source.shape(n)) * source.dtype.itemsize for n in names}
    shards, current = [], []
    for n in names:
        if current and sum(size[m] for m in current) + size[n] > shard_bytes:
            shards.append(current)
            current = []
        current.append(n)
    shards.append(current)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    with tqdm(total=sum(size.values()), desc="writing", unit="B", unit_scale=True, disable=not progress) as bar:
        for file, shard in zip(files, shards):
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for n in shard:
                header[n] = {
                    "dtype": DTYPE_NAMES[source.dtype],
                    "shape": list(source.shape(n)),
                    "data_offsets": [offset, offset + size[n]],
                }
                offset += size[n]
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            with open(out_dir / file, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for n in shard:
                    shape = source.shape(n)
                    rows = max(1, (64 << 20) // max(1, size[n] // shape[0]))
                    for start in range(0, shape[0], rows):
                        piece = source.read_rows(n, start, start + rows)
                        f.write(piece.contiguous().reshape(-1).view(torch.uint8).numpy())
                        bar.update(piece.numel() * piece.element_size())
                        del piece
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(size.values())},
            "weight_map": {n: file for file, shard in zip(files, shards) for n in shard},
        }
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
