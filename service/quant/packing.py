"""Packing a pre-quantized checkpoint's int8 weights for the INT8 kernels, on a thread pool that may
start before the rest of the service is even imported.

Packing is most of a start-up (~0.25 GB/s per thread for oneDNN, less for FBGEMM: ~4 s for the 2B
model's 2.1 GB on 2 cores) and needs only torch and the checkpoint's files, while importing
transformers takes seconds more: `start(...)` (wsgi.py, before it imports the app) packs in the
background while the imports run, and `load_quantized` takes the results. Each pool thread packs on
one torch thread, so no OpenMP thread team is started and the process can fork afterwards
(gunicorn.conf.py's preload). Pure of transformers: this module must stay importable without it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .. import native
from .int4_linear import Int4Linear
from .int8_linear import Int8Linear

log = logging.getLogger(__name__)

QUANTIZED_MARKER = "service_int8"  # the config.json entry of a checkpoint written by `python -m service quantize`
FORMAT = "qwen3-vl-service-int8"
FORMAT_INT4 = "qwen3-vl-service-int4"  # 4-bit Linears (some may stay INT8) — `quantize --bits 4`
FORMAT_VERSION = 1
FORMATS = (FORMAT, FORMAT_INT4)
SCALE = ".weight_scale"
INT4_PARTS = ("qweight", "qzeros", "scales")  # a 4-bit Linear's packed tensors (int4_linear.pack)
INT4_SHAPE = ".qshape"  # int32 [out, in, group] beside them
DTYPES = {
    "I8": torch.int8,
    "U8": torch.uint8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
# fused module → the checkpoint's modules it replaces, in output order, inside each text decoder layer
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
_TEXT_LAYER = re.compile(r"^(model\.language_model\.layers\.\d+)\.(.+)$")  # (layer, module in it)


def quantized_marker(path: Path) -> dict | None:
    """The QUANTIZED_MARKER of the checkpoint at `path`, or None for an ordinary checkpoint."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get(QUANTIZED_MARKER)


def linear_bytes(path: Path, marker: dict) -> int:
    return sum((path / f).stat().st_size for f in marker["linear_shards"])


ALIGNMENT = 64  # bytes: kernels may need aligned weights (bf16 `_weight_int8pack_mm` crashes on 8-aligned ones)
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def write_aligned_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file whose data starts at a multiple of ALIGNMENT (the header padded with spaces,
    as the format allows), the largest tensors first: every tensor whose predecessors' sizes are
    multiples of ALIGNMENT is aligned in the file, and so in memory when the file is mapped."""
    order = sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        size = tensors[name].numel() * tensors[name].element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensors[name].dtype],
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name in order:
            f.write(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy of the bytes


class SafetensorsReader:
    """Reads tensors of one safetensors file with pread into memory the caller owns.

    Used for the weights that get packed: packing copies them anyway, and a read (unlike a mapping)
    leaves no file pages in RSS, so the peak stays near the final size. Safe from several threads.
    """

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        self.entries = json.loads(os.pread(self.fd, length, 8))
        self.entries.pop("__metadata__", None)
        self.data_start = 8 + length

    def close(self) -> None:
        os.close(self.fd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        begin, end = self.entries[name]["data_offsets"]
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        if len(view) != end - begin:
            raise ValueError(f"{name}: {end - begin} bytes in the file, {len(view)} expected")
        done = 0
        while done < len(view):  # pread may return less than asked for very large reads
            done += os.preadv(self.fd, [view[done:]], self.data_start + begin + done)
        return out

    def read(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        return self.read_into(name, torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]]))


def linear_groups(linears: list[str]) -> dict[str, list[str]]:
    """The checkpoint's Linears (names without `.weight`) → the model's Linears, each with the ones
    it is read from: a text decoder layer's q/k/v and gate/up become one each, the rest stay."""
    present, groups = set(linears), {}
    for name in linears:
        match = _TEXT_LAYER.match(name)
        fused = next((f for f, parts in FUSED_PROJECTIONS.items() if match and match[2] in parts), None)
        if fused and all(f"{match[1]}.{p}" in present for p in FUSED_PROJECTIONS[fused]):
            groups[f"{match[1]}.{fused}"] = [f"{match[1]}.{p}" for p in FUSED_PROJECTIONS[fused]]
        else:
            groups[name] = [name]
    return groups


def kernel_of(name: str, kernels) -> str:
    """The kernel for the Linear `name` (all give the same bits): a KernelChoice's vision kernel for
    the vision tower (which only ever sees many rows), its decoder kernel for the text decoder and
    lm_head; a kernel's name, that kernel for all."""
    if isinstance(kernels, str):
        return kernels
    return kernels.vision if name.startswith("model.visual.") else kernels.decoder


def int4_names(keys) -> list[str]:
    """The 4-bit Linears (model names, fused where the model fuses) among a shard's tensor names."""
    return sorted(k[: -len(INT4_SHAPE)] for k in keys if k.endswith(INT4_SHAPE))


def int4_linear(name: str, get, has) -> Int4Linear:
    """The 4-bit Linear `name` from a checkpoint's tensors: `get(key)` gives one (read into memory of
    its own, or a view of a mapped file), `has(key)` tells whether it exists."""
    out_features, in_features, group = (int(v) for v in get(f"{name}{INT4_SHAPE}"))
    packed = {part: get(f"{name}.{part}") for part in INT4_PARTS}
    bias = get(f"{name}.bias") if has(f"{name}.bias") else None
    return Int4Linear(packed, out_features, in_features, group, bias)


def fused_bias(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if all(b is None for b in biases) else torch.cat(biases)


def packed_linear(parts: list[tuple[SafetensorsReader, str]], kernel: str) -> Int8Linear:
    """One Int8Linear from the checkpoint Linears `parts` (several: a fused projection, rows in order),
    read straight into one int8 weight."""
    shapes = [reader.shape(f"{name}.weight") for reader, name in parts]
    scales = torch.cat([reader.read(f"{name}{SCALE}") for reader, name in parts])
    rows = torch.empty((sum(shape[0] for shape in shapes), shapes[0][1]), dtype=torch.int8)
    start = 0
    for (reader, name), (out, _) in zip(parts, shapes):
        reader.read_into(f"{name}.weight", rows[start : start + out])
        start += out
    bias = fused_bias(
        [reader.read(f"{name}.bias") if f"{name}.bias" in reader.entries else None for reader, name in parts]
    )
    return Int8Linear(rows, scales, bias, kernel=kernel)


def _read_int4(reader: SafetensorsReader, name: str) -> Int4Linear:
    def get(key):
        entry = reader.entries[key]
        out = torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        native.huge_pages(out.data_ptr(), out.numel() * out.element_size())  # before the read writes it
        return reader.read_into(key, out)

    return int4_linear(name, get, reader.entries.__contains__)


class Packing:
    """Every Linear of one checkpoint's shards, being packed (INT8) or read (4-bit, already in the
    kernel's layout) on `threads` threads: `results()`."""

    def __init__(self, path: Path, shards: list[str], threads: int, kernels):
        self.began = time.perf_counter()
        self.readers = [SafetensorsReader(Path(path) / shard) for shard in shards]
        reader_of = {key[: -len(".weight")]: r for r in self.readers for key in r.entries if key.endswith(".weight")}
        groups = linear_groups(sorted(reader_of))
        # Largest first: the lm_head alone packs for seconds on one thread, so it must not come last.
        jobs = sorted(groups.items(), key=lambda g: -sum(math.prod(reader_of[p].shape(f"{p}.weight")) for p in g[1]))
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, threads),
            initializer=torch.set_num_threads,
            initargs=(1,),
            thread_name_prefix="int8-packing",
        )
        self.futures: dict[str, Future] = {
            name: self._pool.submit(packed_linear, [(reader_of[p], p) for p in parts], kernel_of(name, kernels))
            for name, parts in jobs
        }
        for reader in self.readers:
            for name in int4_names(reader.entries):
                self.futures[name] = self._pool.submit(_read_int4, reader, name)

    def results(self) -> dict[str, Int8Linear | Int4Linear]:
        """Wait for every Linear; the packed modules by model name (the readers are closed after)."""
        try:
            return {name: future.result() for name, future in self.futures.items()}
        finally:
            self._pool.shutdown()
            for reader in self.readers:
                reader.close()


_started: dict[tuple, Packing] = {}
_lock = threading.Lock()


def _key(path: Path, kernels) -> tuple:
    return str(Path(path).resolve()), kernel_of("", kernels), kernel_of("model.visual.", kernels)


def start(path: Path, shards: list[str], threads: int, kernels) -> None:
    """Begin packing in the background (idempotent); `claim` hands the work to the loader."""
    with _lock:
        if _key(path, kernels) not in _started:
            _started[_key(path, kernels)] = Packing(path, shards, threads, kernels)


def claim(path: Path, kernels) -> Packing | None:
    """The packing `start` began for this checkpoint and these kernels (it found the weights fit), or None."""
    with _lock:
        started = _started.pop(_key(path, kernels), None)
    if started is not None:
        log.info(
            "the INT8 weights have been packing for %.1f s (begun before the app was imported)",
            time.perf_counter() - started.began,
        )
    return started


def int8_kernels(settings, path: Path):
    """The kernels INT8_KERNEL asks for on this checkpoint (measured for "auto": service/quant/kernel_choice.py)."""
    from .kernel_choice import choose

    native.configure(settings.cache_dir)
    return choose(settings.int8_kernel, path, settings.cache_dir, settings.threads, settings.prefill_chunk_tokens)


def start_early(settings) -> None:
    """`start` for the checkpoint `settings` will load, when it is pre-quantized and its packed
    weights fit the memory budget (else the loader maps them, and packing now would be waste)."""
    from ..memory import MemoryGuard

    path = settings.model_path
    marker = quantized_marker(path) if path is not None and settings.quantization == "int8" else None
    if not marker or marker.get("format") not in FORMATS or marker.get("version") != FORMAT_VERSION:
        return  # not one: the loader reports what is wrong, if anything
    if not MemoryGuard.from_settings(settings).fits(linear_bytes(path, marker)):
        return
    start(path, marker["linear_shards"], settings.threads, int8_kernels(settings, path))
