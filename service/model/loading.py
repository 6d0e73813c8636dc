"""Load a Qwen3-VL checkpoint directory (or the embedded tiny one): processor and model, fp32 or INT8."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..footprint import check_fits
from ..media.images import fit_processor
from ..memory import MemoryGuard
from ..quant.fusion import fuse_projections, model_class
from ..quant.packing import FORMAT_INT4, int8_kernels
from ..quant.quantized import load_quantized, published_checkpoint, quantize_in_place, quantized_marker
from ..settings import Settings
from ..threads import in_own_thread
from .checkpoints import RANDOM_MODEL_WARNING, embedded_model_dir, is_random_test_model

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    processor: object
    path: Path
    name: str
    quantization: str
    is_random: bool
    load_seconds: float
    eos_token_ids: list[int] = field(default_factory=list)
    prequantized: bool = False  # loaded from an INT8 checkpoint (`python -m service quantize`)
    kernels: object = None  # INT8: the KernelChoice (service/quant/kernel_choice.py) its Linears run
    weights_mapped: bool = False  # Linear weights memory-mapped: the model did not fit MAX_MEMORY_MB


def _processor_class():
    from transformers import Qwen3VLProcessor

    class VideoLessQwen3VLProcessor(Qwen3VLProcessor):
        """Qwen3VLProcessor without a video processor (transformers' one needs torchvision).

        The stock class type-checks every attribute and rejects None; only that check is relaxed.
        """

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return VideoLessQwen3VLProcessor


def load_processor(path: Path):
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = AutoImageProcessor.from_pretrained(path)
    chat_template = tokenizer.chat_template
    template_file = path / "chat_template.jinja"
    if chat_template is None and template_file.exists():
        chat_template = template_file.read_text()
    if chat_template is None:
        raise ValueError(f"{path} has no chat template (chat_template.jinja or tokenizer_config.json)")
    return _processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=None, chat_template=chat_template
    )


class _OnceWarnings:
    """Collects library warnings during a phase and logs each distinct one once."""

    def __enter__(self):
        self._ctx = warnings.catch_warnings(record=True)
        self._records = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        for message in sorted({str(r.message).splitlines()[0] for r in self._records}):
            log.info("library warning (shown once): %s", message)
        return False


def load_model(settings: Settings, threads: int | None = None) -> LoadedModel:
    """Load MODEL_PATH (or build and load the embedded tiny model) as settings say, computing on
    `threads` torch threads (default THREADS) of a thread of its own, which ends with the load: the
    caller is left without an OpenMP team (service/threads.py; a process that forks afterwards must
    not hold one), and the engine's scheduler computes on THREADS for itself."""
    return in_own_thread(lambda: _load(settings), threads or settings.threads, "model-load")


def _load(settings: Settings) -> LoadedModel:
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
    path = settings.model_path or embedded_model_dir(settings.cache_dir)
    processor = load_processor(path)
    fit_processor(processor, settings)
    hf_logging.set_verbosity_error()
    path = published_checkpoint(path, settings)  # GPTQ/AWQ: converted once (exactly) into CACHE_DIR
    marker = quantized_marker(path)
    prequantized, mapped = marker is not None, False
    if prequantized and settings.quantization != "int8":
        raise ValueError(
            f"{path} is a quantized checkpoint (made by `python -m service quantize`): use "
            "QUANTIZATION=int8, or point MODEL_PATH at the original checkpoint for fp32"
        )
    kernels = int8_kernels(settings, path) if settings.quantization == "int8" else None
    with _OnceWarnings():
        if prequantized:
            model, mapped = load_quantized(path, settings.threads, MemoryGuard.from_settings(settings), kernels)
        else:
            check_fits(path, settings.quantization, MemoryGuard.from_settings(settings).budget_bytes)
            # The checkpoint's own dtype (bf16 for Qwen's releases): no whole fp32 copy before quantizing.
            dtype = "auto" if settings.quantization == "int8" else torch.float32
            # Qwen3-VL or Qwen3-VL-MoE, as the config says
            model = model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype)
            model.eval()
            fuse_projections(model)
            if settings.quantization == "int8":
                model.requires_grad_(False)
                quantize_in_place(model, kernel=kernels)
            model.float()  # embeddings, norms, patch embedding: fp32 compute (bf16 is slow on these CPUs)
    model.requires_grad_(False)
    is_random = is_random_test_model(model.config)
    if is_random:
        log.warning(RANDOM_MODEL_WARNING)
    eos = model.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    tok = processor.tokenizer
    for token in ("<|im_end|>", "<|endoftext|>"):
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid >= 0 and tid not in eos_ids:
            eos_ids.append(tid)
    loaded = LoadedModel(
        model=model,
        processor=processor,
        path=path,
        name="embedded-random-tiny-qwen3-vl" if settings.model_path is None else path.name,
        quantization="int4" if prequantized and marker.get("format") == FORMAT_INT4 else settings.quantization,
        is_random=is_random,
        load_seconds=time.perf_counter() - start,
        eos_token_ids=eos_ids,
        prequantized=prequantized,
        weights_mapped=mapped,
        kernels=kernels,
    )
    log.info(
        "loaded %s (%s%s) from %s in %.1f s",
        loaded.name,
        f"{loaded.quantization}, INT8 kernels: {kernels.describe()}" if kernels else "fp32",
        ", pre-quantized" if prequantized else "",
        path,
        loaded.load_seconds,
    )
    return loaded
