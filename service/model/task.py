"""What a checkpoint serves — chat, embedding (Qwen3-VL-Embedding) or rerank (Qwen3-VL-Reranker) — as
MODEL_TASK says, or told from the checkpoint.

The three releases share Qwen3-VL's config, classes and chat template (QwenLM/Qwen3-VL-Embedding, commit
8ce3aab; the releases' config.json name `Qwen3VLForConditionalGeneration`). What tells them apart:
Qwen3-VL-Embedding-8B's config is untied yet its files hold no `lm_head.weight` (its head is never used:
QwenLM/Qwen3-VL-Embedding#89) — an untied checkpoint without a head is an embedding model, its missing
head tied to the embedding so that it loads (and quantizes) as a tied one; otherwise only the name says
it (`…Embedding…`, `…Reranker…`): a reranker holds a chat model's every tensor, so a renamed one is
told by MODEL_TASK alone, as is a renamed `quantize` copy of either (its files are the service's own:
an untied Qwen3.5 copy holds no `lm_head.weight` either, and is no embedding model).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..quant.packing import quantized_marker

TASKS = ("chat", "embedding", "rerank")


def stored_tensor_names(path: Path) -> set[str] | None:
    """The tensor names of an ordinary safetensors checkpoint (from its index or its files' headers),
    None for another format (the service's quantized one: its own marker says what it holds)."""
    if quantized_marker(path) is not None:
        return None
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(file, "pt") as f:
            names.update(f.keys())
    return names


def is_headless(path: Path, config) -> bool:
    """An untied checkpoint whose files hold no lm_head: only an embedding model can be served from it."""
    if getattr(config, "tie_word_embeddings", False):
        return False
    names = stored_tensor_names(Path(path))
    return names is not None and "lm_head.weight" not in names and any(n.endswith("embed_tokens.weight") for n in names)


def task_by_name(name: str) -> str:
    """The task a checkpoint directory's name tells (…Embedding… / …Reranker…), chat otherwise."""
    lowered = name.lower()
    if "rerank" in lowered:
        return "rerank"
    if "embedding" in lowered:
        return "embedding"
    return "chat"


def checkpoint_task(setting: str, path: Path, name: str, config) -> str:
    """The task MODEL_TASK (`setting`) names, or with `auto` the one the checkpoint at `path` (named
    `name`: its directory as the user gave it) tells."""
    if setting != "auto":
        return setting
    if is_headless(path, config):
        return "embedding"
    return task_by_name(name)


def tie_missing_head(config) -> None:
    """An embedding checkpoint without an lm_head loads as a tied one: the head, never used, is the embedding."""
    config.tie_word_embeddings = True
    text = getattr(config, "text_config", None)
    if text is not None:
        text.tie_word_embeddings = True
