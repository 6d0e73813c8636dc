"""Load a Qwen3-VL checkpoint directory (or the embedded tiny one): processor and model, fp32, INT8 or 4-bit."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .. import startup
from ..footprint import check_fits
from ..media.images import fit_processor
from ..memory import MemoryGuard
from ..native import float_ops
from ..quant.conversion import current_format, published_checkpoint
from ..quant.in_place import quantize_in_place
from ..quant.loader import load_quantized
from ..quant.packing import FORMAT_INT4, int8_kernels, quantized_marker
from ..random_checkpoints.embedded import embedded_model_dir
from ..random_checkpoints.marker import RANDOM_MODEL_WARNING, is_random_test_model
from ..settings import Settings
from ..threads import in_own_thread
from .skeleton import head_layers, skeleton
from .task import checkpoint_task, is_headless, tie_missing_head
from .weights import generation_config, load_weights

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
    # INT8 Linears the native kernel serves until their measured kernel's layout is packed (warm_up)
    pending_packing: list = field(default_factory=list)
    task: str = "chat"  # chat, embedding or rerank (service/model/task.py)


def load_processor(path: Path):
    """The checkpoint's tokenizer, image processor and chat template: the service's own processor
    (service/model/processor.py: transformers' processor imports its modeling code, seconds of a start)."""
    from .processor import Processor

    return Processor.load(path)


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
    fit_processor(processor)
    startup.mark("processor")
    hf_logging.set_verbosity_error()
    path = published_checkpoint(path, settings)  # GPTQ/AWQ: converted once (exactly) into CACHE_DIR
    path = current_format(path, settings)  # a format-1 quantized checkpoint: likewise
    marker = quantized_marker(path)
    prequantized, mapped = marker is not None, False
    if prequantized and settings.quantization != "int8":
        raise ValueError(
            f"{path} is a quantized checkpoint (made by `python -m service quantize`): use "
            "QUANTIZATION=int8, or point MODEL_PATH at the original checkpoint for fp32"
        )
    kernels = int8_kernels(settings, path) if settings.quantization == "int8" else None
    pending: list = []
    with _OnceWarnings():
        config = AutoConfig.from_pretrained(path)
        task = checkpoint_task(settings.model_task, path, (settings.model_path or path).name, config)
        if task == "embedding" and is_headless(path, config):
            tie_missing_head(config)
        model = skeleton(config, mtp=settings.mtp_drafting == "on")  # Qwen3-VL or Qwen3.5, as the config says
        if settings.mtp_drafting == "on" and head_layers(config) > 1:
            log.warning("a multi-token prediction head of %d layers: not drafted with (one only)", head_layers(config))
        model.generation_config = generation_config(path, model.config)
        if prequantized:
            guard = MemoryGuard.from_settings(settings)
            # A measured choice of FBGEMM or oneDNN is packed after the start (warm_up); a forced one now.
            later = None if kernels is None or kernels.forced else pending
            mapped = load_quantized(model, path, settings.threads, guard, kernels, later)
        else:
            check_fits(path, settings.quantization, MemoryGuard.from_settings(settings).budget_bytes)
            # The checkpoint's own dtype (bf16 for Qwen's releases): no whole fp32 copy before quantizing.
            load_weights(model, path, None if settings.quantization == "int8" else torch.float32)
            model.eval()
            if settings.quantization == "int8":
                model.requires_grad_(False)
                quantize_in_place(model, kernel=kernels)
            model.float()  # embeddings, norms, patch embedding: fp32 compute (bf16 is slow on these CPUs)
    model.requires_grad_(False)
    # fp32 weights: every Linear a fixed-order GEMM (MKL's rounding follows the CPU and the number of rows)
    if float_ops.fixed_order_linears(model):
        log.info("fp32 Linears computed in fixed order (service/native/float_ops.py)")
    startup.mark("weights")
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
        pending_packing=pending,
        task=task,
    )
    if pending:
        log.info(
            "%d INT8 Linears served by the native kernel until their measured kernel's layout is packed, "
            "after the start (the same bits)",
            len(pending),
        )
    log.info(
        "loaded %s (%s%s%s) from %s in %.1f s, serving %s",
        loaded.name,
        f"{loaded.quantization}, INT8 kernels: {kernels.describe()}" if kernels else "fp32",
        ", pre-quantized" if prequantized else "",
        ", with its multi-token prediction head" if getattr(model, "mtp", None) is not None else "",
        path,
        loaded.load_seconds,
        {"chat": "chat", "embedding": "embeddings (/v1/embeddings)", "rerank": "relevance scores (/v1/rerank)"}[task],
    )
    return loaded


def warm_up(loaded: LoadedModel) -> threading.Thread | None:
    """In the process that serves, once it is ready: its mappings of the weights populated
    (service/model/prefault.py) and the pending INT8 Linears packed for their measured kernel, one
    at a time, on a background thread at the lowest CPU priority — requests are served meanwhile, by
    the native kernel until each packed Linear replaces it (the same bits). Returns that thread."""
    from ..quant.loader import pack_pending
    from . import prefault

    prefault.prefault(loaded.path)
    pending, loaded.pending_packing = loaded.pending_packing, []
    if not pending:
        return None

    def pack():
        torch.set_num_threads(1)
        with contextlib.suppress(OSError):  # Linux nices a thread by its id
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        seconds = pack_pending(loaded.model, pending)
        log.info("%d INT8 Linears packed for their measured kernel in %.1f s, after the start", len(pending), seconds)

    thread = threading.Thread(target=pack, name="int8-packing", daemon=True)
    thread.start()
    return thread
