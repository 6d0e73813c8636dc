"""What names a checkpoint's weights without reading them all: caches kept outside the process (the
KV disk tier) are only valid for the weights that made them."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

SAMPLE_BYTES = 64 * 1024


@functools.lru_cache(maxsize=8)  # one reading a process: the fingerprint, the digest and the disk tier ask
def checkpoint_identity(path: Path) -> str:
    """A digest of the checkpoint folder's config and of each weight file's name, size and bytes at its
    start, middle and end: copies of one checkpoint agree wherever they live, while a fine-tune, a
    re-quantization or another shard layout differs (a header alone could match; sampled tensor bytes
    do not). Reads a few hundred KiB, not the weights."""
    path = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    digest.update((path / "config.json").read_bytes())
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def serving_fingerprint(path: Path, *computed_with) -> str:
    """OpenAI's `system_fingerprint`: "fp_" and a digest of the checkpoint's identity and of what
    computes with it (quantization, kernels, KV dtype): instances serving the same bits show the same."""
    parts = json.dumps([checkpoint_identity(path), *computed_with], sort_keys=True, default=str)
    return "fp_" + hashlib.blake2b(parts.encode(), digest_size=6).hexdigest()


def numerics_identity(path: Path, quantization: str, kv_dtype: str, vision_backend: str, weights_mapped: bool) -> str:
    """What an answer's numbers depend on besides the request (service/answer/digest.py): the checkpoint's
    identity and the settings that change them — QUANTIZATION, KV_DTYPE, VISION_BACKEND and whether the
    weights are memory-mapped (bf16 activations). Not the CPU, its instruction set or the INT8 kernel
    that serves: those give the same bits."""
    weights = "mapped" if weights_mapped else "resident"
    return json.dumps([checkpoint_identity(path), quantization, kv_dtype, vision_backend, weights])
