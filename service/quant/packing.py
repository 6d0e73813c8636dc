"""The quantized checkpoint format (`python -m service quantize`, `make-model --bits`): its marker,
its tensors' names, and the helpers that write and read them.

Format 2 stores each model Linear as the kernels compute it — INT8 ones fused (q/k/v, gate/up) in the
native kernel's layout (service/native/int8_gemm.c, the same on every CPU), 4-bit ones in the 4-bit
kernel's — so a start maps the files and uses them in place (service/quant/loader.load_quantized):
no packing, one copy in the page cache for every process on the machine. Pure of transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path

import torch

from .. import native
from .int4_linear import Int4Linear

log = logging.getLogger(__name__)

QUANTIZED_MARKER = "service_int8"  # the config.json entry of a checkpoint written by `python -m service quantize`
FORMAT = "qwen3-vl-service-int8"
FORMAT_INT4 = "qwen3-vl-service-int4"  # 4-bit Linears (some may stay INT8) — `quantize --bits 4`
# 2: INT8 Linears stored fused (q/k/v, gate/up) in the native kernel's layout, mapped and used in place;
# 1: int8 rows as the checkpoint's Linears, packed at every start (converted once into CACHE_DIR now).
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2)
FORMATS = (FORMAT, FORMAT_INT4)
SCALE = ".weight_scale"
PACKED = ".packed"  # an INT8 Linear's weights in int8_gemm.c's layout (int8_linear.pack_native), flat
COLUMN_SUMS = ".column_sums"  # int32 [out]: each output channel's weight sum
PACKED_SHAPE = ".packed_shape"  # int32 [out, in] of the packed Linear
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
# A decoder layer's Linears that share an input, as the model computes them: one Linear each, its rows
# the checkpoint's parts in this order (Qwen3.5's linear attention: q/k/v and z, b and a; its shared expert's gate/up).
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    # two, as vLLM fuses them: a published checkpoint may leave the small b and a unquantized
    "linear_attn.in_proj_qkvz": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
}
# (layer, module in it): the model's decoder layers and its multi-token prediction head's (Qwen3.5's `mtp`)
_TEXT_LAYER = re.compile(r"^((?:model\.language_model|mtp)\.layers\.\d+)\.(.+)$")


def native_int8_tensors(name: str, rows: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """The tensors format 2 stores for the INT8 Linear `name` (rows: int8 [out, in], fused already)."""
    from .int8_linear import pack_native

    packed, sums = pack_native(rows)
    out = {
        f"{name}{PACKED}": packed,
        f"{name}{COLUMN_SUMS}": sums,
        f"{name}{SCALE}": scales.float(),
        f"{name}{PACKED_SHAPE}": torch.tensor(list(rows.shape), dtype=torch.int32),
    }
    if bias is not None:
        out[f"{name}.bias"] = bias.float()
    return out


def native_int8_names(keys) -> list[str]:
    """The INT8 Linears stored in the native layout among a shard's tensor names."""
    return sorted(k[: -len(PACKED_SHAPE)] for k in keys if k.endswith(PACKED_SHAPE))


def quantized_marker(path: Path) -> dict | None:
    """The QUANTIZED_MARKER of the checkpoint at `path`, or None for an ordinary checkpoint."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return json.loads(config.read_text()).get(QUANTIZED_MARKER)


def linear_bytes(path: Path, marker: dict) -> int:
    return sum((path / f).stat().st_size for f in marker["linear_shards"])


ALIGNMENT = 64  # bytes: kernels may need aligned weights (bf16 `_weight_int8pack_mm` crashes on 8-aligned ones)
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def write_aligned_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A safetensors file whose data starts at a multiple of ALIGNMENT (the header padded with spaces,
    as the format allows), the largest tensors first: every tensor whose predecessors' sizes are
    multiples of ALIGNMENT is aligned in the file, and so in memory when the file is mapped."""
    order = sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in order:
        size = tensors[name].numel() * tensors[name].element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensors[name].dtype],
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


def int8_kernels(settings, path: Path):
    """The kernels INT8_KERNEL asks for on this checkpoint (measured for "auto": service/quant/kernel_choice.py)."""
    from .kernel_choice import choose

    native.configure(settings.cache_dir)
    return choose(settings.int8_kernel, path, settings.cache_dir, settings.threads, settings.prefill_chunk_tokens)
