"""Decode's bandwidth ceiling: the bytes of weights one token reads, over what this machine reads a second.

A decode step reads every text weight once (attention, norms, routers, the output head) but, in a
mixture of experts, only its top-k experts of each layer; the vision tower, the embedding table (one
row) and Qwen3.5's multi-token prediction head (`mtp.*`, which only drafts: decoding with speculation
off, as the compared rows do, never runs it) it does not read. At best a token then takes active bytes ÷
read bandwidth: the ceiling a decode rate is compared with. Both sides are counted from their files:
this service's checkpoint (safetensors headers) and llama.cpp's GGUF (its tensor table).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

GIB = 1024**3


def read_bandwidth(threads: int, size: int = 2 * GIB, repeats: int = 5) -> float:
    """Bytes a second `threads` threads read summing a `size`-byte tensor (the best of `repeats`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(size // 4, dtype=torch.float32)
        x.sum()
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - started)
        return size / best
    finally:
        torch.set_num_threads(before)


def _experts(config: dict) -> tuple[int, int]:
    """(experts per layer, experts a token reads) of a checkpoint's config.json, (1, 1) if dense."""
    text = config.get("text_config", config)
    experts = text.get("num_experts") or text.get("num_local_experts") or 1
    return experts, text.get("num_experts_per_tok") or 1


def _safetensors_sizes(directory: Path) -> dict[str, int]:
    """name → bytes of every tensor in a checkpoint directory's safetensors files (headers only)."""
    from service.footprint import safetensors_entries

    return {name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in safetensors_entries(directory)}


def _active(sizes: dict[str, int], experts: tuple[int, int], is_expert, is_skipped) -> int:
    total, chosen = experts
    active = 0.0
    for name, size in sizes.items():
        if is_skipped(name):
            continue
        active += size * chosen / total if is_expert(name) else size
    return int(active)


def checkpoint_active_bytes(directory: Path) -> int:
    """Bytes of weights one decoded token reads from this service's checkpoint `directory`."""
    config = json.loads((directory / "config.json").read_text())
    sizes = _safetensors_sizes(directory)
    tied = not any(name.startswith("lm_head.") for name in sizes)  # then the output head is the table
    return _active(
        sizes,
        _experts(config),
        lambda name: ".mlp.experts." in name,
        lambda name: name.startswith(("model.visual.", "mtp.")) or (not tied and ".embed_tokens." in name),
    )


def gguf_active_bytes(path: Path, llama_source: Path, experts: tuple[int, int]) -> int:
    """Bytes of weights one decoded token reads from a llama.cpp text GGUF (its own gguf-py reads it)."""
    sys.path.insert(0, str(llama_source / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    sizes = {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}
    tied = "output.weight" not in sizes
    return _active(sizes, experts, lambda name: "_exps." in name, lambda name: not tied and name == "token_embd.weight")


def model_experts(directory: Path) -> tuple[int, int]:
    return _experts(json.loads((directory / "config.json").read_text()))
