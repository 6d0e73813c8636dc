"""Loading a quantized checkpoint (format 2: service/quant/writer.py) into the service's modules on the
meta device, every tensor a view of its mapped files (`load_quantized`); the Linears whose measured
kernel packs a layout of its own are packed after the start (`pack_pending`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..memory import MIB, MemoryGuard, release_memory
from . import packing
from .int8_linear import Int8Embedding, Int8Linear, MappedInt8Linear
from .packing import (
    COLUMN_SUMS,
    FORMAT_VERSION,
    FORMATS,
    PACKED,
    PACKED_SHAPE,
    SCALE,
    int4_linear,
    int4_names,
    kernel_of,
    linear_bytes,
    quantized_marker,
)
from .structure import drop_absent_head, embedding_name, replace_module, set_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingPack:
    """An INT8 Linear the native kernel serves until the measured kernel's layout of it is packed."""

    name: str
    args: tuple  # Int8Linear's arguments for the measured kernel


def pack_pending(model: nn.Module, pending: list[PendingPack]) -> float:
    """Pack each pending Linear for its measured kernel and swap it in (a Linear at a time: a forward
    under way keeps the module it started with; both give the same bits). Returns the seconds taken."""
    started = time.perf_counter()
    for job in pending:
        replace_module(model, job.name, Int8Linear(*job.args))
    return time.perf_counter() - started


def load_quantized(
    model: nn.Module,
    path: Path,
    threads: int,
    memory: MemoryGuard | None = None,
    kernel="fbgemm",
    deferred: list[PendingPack] | None = None,
) -> bool:
    """Fill `model` (the service's modules on the meta device: service/model/skeleton.py) from a
    quantized checkpoint (format 2); whether its weights are over the memory budget.

    Every tensor is a view of the checkpoint's files, mapped read-only: the native INT8 kernel and the
    4-bit kernel compute from the stored layout in place — nothing is copied or packed, the page cache
    holds one copy for every process on the machine, and a warm start reads nothing from disk. Linears
    the measured choice gives to FBGEMM or oneDNN are packed for them on `threads` threads (their own
    memory) — or, given a `deferred` list and a native kernel, served by the native kernel from the
    mapping for now, their packing appended to `deferred` (`pack_pending` swaps the packed Linears
    in later, off the start path: the same bits). Over the memory budget every INT8 Linear runs on
    the native kernel from the mapping (the OS may drop pages and read them back), unless this
    machine cannot build it.
    """
    from concurrent.futures import ThreadPoolExecutor

    from safetensors import safe_open

    from .int8_linear import PackedInt8Embedding, available_kernels, unpack_native

    path = Path(path)
    marker = quantized_marker(path)
    if not marker or marker.get("format") not in FORMATS:
        raise ValueError(f"{path} is not a checkpoint written by `python -m service quantize`")
    if marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format version {marker.get('version')}; this service reads {FORMAT_VERSION} "
            "(the loader converts older ones once: service/quant/conversion.current_format)"
        )
    over_budget = memory is not None and not memory.fits(linear_bytes(path, marker))
    has_native = "native" in available_kernels()
    if over_budget:
        log.warning(
            "the quantized weights (%.1f MiB) are more than MAX_MEMORY_MB leaves (%.0f MiB used of %.0f): "
            "they are served from the mapped files%s; the OS may drop pages and read them back from %s",
            linear_bytes(path, marker) / MIB,
            memory.used_bytes() / MIB,
            memory.budget_bytes / MIB,
            " on the native kernel" if has_native else "",
            path,
        )
    # Kept open for the process's life: every tensor below is a view of a mapped file.
    resident = safe_open(path / marker["resident"], "pt")
    embed_name = embedding_name(model)
    padding_idx = model.get_submodule(embed_name).padding_idx
    skipped = () if getattr(model, "mtp", None) is not None else ("mtp.",)  # a head not loaded (MTP_DRAFTING=off)
    for name in resident.keys():
        if name.endswith(SCALE) or name.startswith(skipped):
            continue
        module_name = name.rpartition(".")[0]
        if module_name == embed_name:
            table = Int8Embedding(resident.get_tensor(name), resident.get_tensor(f"{module_name}{SCALE}"), padding_idx)
            replace_module(model, embed_name, table)
        else:
            set_tensor(model, name, resident.get_tensor(name))
    layouts, packing_jobs = {}, {}
    for f in (safe_open(path / shard, "pt") for shard in marker["linear_shards"]):
        keys = set(f.keys())
        for name in packing.native_int8_names(keys):
            if name.startswith(skipped):
                continue
            out_features, in_features = (int(v) for v in f.get_tensor(f"{name}{PACKED_SHAPE}"))
            layout = f.get_tensor(f"{name}{PACKED}"), f.get_tensor(f"{name}{COLUMN_SUMS}")
            scales = f.get_tensor(f"{name}{SCALE}")
            bias = f.get_tensor(f"{name}.bias") if f"{name}.bias" in keys else None
            layouts[name] = layout[0], scales, in_features
            chosen = "native" if over_budget and has_native else kernel_of(name, kernel)
            later = chosen != "native" and deferred is not None and has_native and not over_budget
            if chosen == "native" or later:
                replace_module(model, name, Int8Linear(None, scales, bias, "per_token", "native", layout, in_features))
                if later:
                    deferred.append(PendingPack(name, (None, scales, bias, "per_token", chosen, layout, in_features)))
            elif over_budget:  # no native kernel here: the weights' rows in memory after all
                rows = unpack_native(layout[0], out_features, in_features)
                replace_module(model, name, MappedInt8Linear([(rows, scales)], bias))
            else:
                packing_jobs[name] = (None, scales, bias, "per_token", chosen, layout, in_features)
        for name in int4_names(keys):  # the 4-bit kernel computes from the stored layout as it is
            if name.startswith(skipped):
                continue
            replace_module(model, name, int4_linear(name, f.get_tensor, keys.__contains__))
    if packing_jobs:  # FBGEMM's or oneDNN's own layouts, made on `threads` threads of one OpenMP thread each
        with ThreadPoolExecutor(max(1, threads), initializer=torch.set_num_threads, initargs=(1,)) as pool:
            made = pool.map(lambda args: Int8Linear(*args), packing_jobs.values())
            for name, module in zip(packing_jobs, made):
                replace_module(model, name, module)
    embed = model.get_submodule(embed_name)
    if isinstance(embed, nn.Embedding) and embed.weight.is_meta:
        if "lm_head" not in layouts:
            raise ValueError(f"{path} is incomplete: no embedding, and no INT8 lm_head to read it from")
        packed, scales, hidden = layouts["lm_head"]  # tied: the embedding is the lm_head's packed rows
        replace_module(model, embed_name, PackedInt8Embedding(packed, scales, hidden, padding_idx))
    release_memory(full=True)
    drop_absent_head(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path} is incomplete: no weights for {left[:3]} (and {max(0, len(left) - 3)} more)")
    model.eval()
    model.requires_grad_(False)
    return over_budget
