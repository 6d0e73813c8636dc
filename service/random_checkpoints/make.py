"""Random-weight checkpoints (`python -m service make-model`): any preset (service/random_checkpoints/presets.py)
written as a real checkpoint — config, safetensors, a trained byte-level BPE tokenizer, chat template,
image-processor config — that loads through the same loader as a downloaded one; or straight into the
INT8 or 4-bit format. The weights are random, so their answers are noise.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from . import qwen35 as qwen35_tokens
from .marker import RANDOM_MODEL_MARKER
from .presets import model_config, preset_of
from .safetensors_writer import write_safetensors
from .tokenizer import train_tokenizer

log = logging.getLogger(__name__)


def write_image_processor_config(out_dir: Path) -> None:
    """The Qwen3-VL-2B-Instruct preprocessor settings (patch 16, merge 2, mean/std 0.5)."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen3VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_checkpoint(
    preset: str,
    out_dir: str | os.PathLike,
    bits: int | None = None,
    progress: bool = False,
    per_tensor_seeds: bool | None = None,
    shapes: dict | None = None,
    **quantization,
) -> Path:
    """Write a random-weight checkpoint of `preset` to `out_dir`, deterministically (seeded).

    `tiny` is the embedded test model (fp32, ~1 MB, ~1 s: service/random_checkpoints/embedded.py),
    `tiny-moe` its mixture-of-experts twin (8 experts, top 4, untied embedding) and `tiny-thinking` its
    Thinking twin (`2b-thinking` likewise for 2B: a Thinking chat template and the <think> tags); `2b`,
    `4b` and `8b` have the exact shapes of Qwen3-VL-2B, -4B and -8B, stored in bf16 like the real
    checkpoints (~4.3, ~8.9 and ~17.5 GB), and `30b-a3b-e32` 30B-A3B's with 32 experts (~18.6 GB).

    bits=8 or 4: the same weights written straight into `python -m service quantize`'s INT8 or 4-bit
    format (`quantization`: its group_size, symmetric, keep_8bit), each tensor generated, quantized and
    written, then freed — the only way to write `30b-a3b` (~62 GB in bf16). Either way the weights come
    from service/random_checkpoints/random_weights.py, seeded per tensor (`per_tensor_seeds`, by default every preset
    but `tiny`, which keeps its whole-model initialisation), so `make-model --bits 4` writes the very
    tensors `make-model` then `quantize --bits 4` would.
    """
    from ..quant import estimates, writer
    from . import random_weights

    recipe = preset_of(preset)
    if bits is None and recipe.quantized_only:
        config = model_config(preset, shapes=shapes)
        raise ValueError(
            f"preset {preset!r} would be ~{estimates.estimated_bytes(config, None) / 1e9:.0f} GB in bf16: write it "
            f"straight into the 4-bit format (~{estimates.estimated_bytes(config, 4) / 1e9:.1f} GB), "
            f"`python -m service make-model --preset {preset} --bits 4 DIR`, or take `30b-a3b-e32` "
            "(its shapes with 32 experts) where a bf16 checkpoint is needed"
        )
    out_dir = Path(out_dir)
    if bits is not None:
        spec = writer.quantization_spec(
            bits,
            quantization.get("group_size", writer.GROUP_SIZE),
            quantization.get("symmetric", False),
            quantization.get("keep_8bit", writer.KEEP_8BIT),
        )
        writer.check_empty(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    qwen35 = recipe.family == "qwen3_5"
    family = qwen35_tokens if qwen35 else None
    words = ("yes", "no") if recipe.task == "rerank" else ()  # the reranker's answer tokens
    ids = train_tokenizer(out_dir, 1024 if recipe.tiny else 4096, thinking=recipe.thinking, family=family, words=words)
    write_image_processor_config(out_dir)
    # The tiny models' vocabulary is exactly their tokenizer's, so every sampled id decodes to text.
    vocabulary = qwen35_tokens.VOCAB_SIZE if qwen35 else 151936
    config = model_config(preset, ids, max(ids.values()) + 1 if recipe.tiny else vocabulary, shapes)
    dtype = torch.float32 if recipe.tiny else torch.bfloat16
    config.dtype = dtype
    setattr(config, RANDOM_MODEL_MARKER, True)
    per_tensor = not recipe.whole_model_init if per_tensor_seeds is None else per_tensor_seeds
    if bits is None and not per_tensor:  # the embedded tiny model, as it has always been written
        model = random_weights.legacy_model(config, dtype)
        model.generation_config.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
        model.generation_config.pad_token_id = ids["<|endoftext|>"]
        model.save_pretrained(out_dir, max_shard_size="2GB")
        return out_dir
    write_generation_config(config, ids, out_dir)
    if per_tensor:
        source, how = random_weights.RandomTensors(config, dtype), "seeded per tensor"
    else:
        source, how = random_weights.legacy_tensors(config, dtype), "torch.manual_seed(0), whole model"
    if recipe.headless:  # as the release: no lm_head stored (loaded tied to the embedding, never used)
        source.shapes.pop("lm_head.weight", None)
        if bits is not None:  # the quantized format records it as what it loads as: tied
            config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    config_dict = config_json(config)
    if bits is None:
        write_safetensors(source, out_dir, progress=progress)
        (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    else:
        marker = writer.write_quantized_tensors(
            source,
            config,
            out_dir,
            spec,
            made_by=f"python -m service make-model --preset {preset} --bits {bits}",
            source_path=f"random weights ({how}: service/random_checkpoints/random_weights.py)",
            source_dtype=str(dtype).removeprefix("torch."),
            progress=progress,
            **({"shard_bytes": quantization["shard_bytes"]} if "shard_bytes" in quantization else {}),
        )
        writer.write_config(out_dir, config_dict, marker)
    log.info("wrote %s random checkpoint to %s in %.1f s", preset, out_dir, time.perf_counter() - start)
    return out_dir


def write_generation_config(config, ids: dict[str, int], out_dir: Path) -> None:
    """generation_config.json: the config's defaults, ending at <|im_end|> or <|endoftext|>."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    generation.pad_token_id = ids["<|endoftext|>"]
    generation.save_pretrained(out_dir)


def config_json(config) -> dict:
    """config.json's contents, as save_pretrained writes them for the model of `config`."""
    from ..quant.fusion import model_class

    config.architectures = [model_class(config).__name__]
    return json.loads(config.to_json_string(use_diff=True))
