"""What a checkpoint needs in memory, from its files alone (no torch: the instance planner uses it
before anything heavy is imported), and the refusal of one that cannot fit the budget."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

GIB = 1024**3

# A 4-bit weight's bytes (service/quant/int4_linear.py): its 4-bit value, and per group of inputs an fp16
# scale and a u8 zero point; groups of 128 are `quantize --bits 4`'s default and what GPTQ/AWQ publish.
INT4_GROUP = 128
INT4_BYTES_PER_WEIGHT = 0.5 + (2 + 1) / INT4_GROUP  # 0.523; an INT8 weight is 1 byte (+ 4 per output row)
# Resident bytes per parameter, (steady, peak while loading). fp32 and int8: measured on Qwen3-VL-2B.
# int4: an estimate, int8's steady figure with each weight's byte replaced by INT4_BYTES_PER_WEIGHT, and
# no higher peak (a 4-bit checkpoint is read in its final layout: nothing is quantized at load); it is
# above what bench/RESULTS.md § “4-bit weights: memory, served in a 2048 MiB cgroup” measured.
_INT4_STEADY = 1.8 - (1 - INT4_BYTES_PER_WEIGHT)
BYTES_PER_PARAMETER = {"fp32": (4.2, 6.2), "int8": (1.8, 3.8), "int4": (_INT4_STEADY, _INT4_STEADY)}
# How a checkpoint says it is quantized: the config.json entry `python -m service quantize` writes and its
# 4-bit format (service/quant/packing.QUANTIZED_MARKER and FORMAT_INT4, repeated: that module imports
# torch, which the planner does not), or a published GPTQ/AWQ `quantization_config` (4-bit only).
QUANTIZED_MARKER = "service_int8"
FORMAT_INT4 = "qwen3-vl-service-int4"
PUBLISHED_METHODS = ("gptq", "awq")
# A quantized Linear's bookkeeping beside its weights (packed 4-bit `qweight`, or int8 `weight`): not parameters.
_QUANTIZATION_PARTS = (".qzeros", ".scales", ".g_idx", ".qshape", ".weight_scale", ".column_sums", ".packed_shape")
RUNTIME_BYTES = 512 * 1024**2  # Python, torch, transformers, Gunicorn: resident before any weight


def safetensors_entries(model_dir: Path):
    """(name, header entry) of every tensor in a checkpoint's safetensors files, from their headers alone."""
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        yield from ((name, entry) for name, entry in header.items() if name != "__metadata__")


def checkpoint_parameters(model_dir: Path) -> int:
    """Parameters in a checkpoint's safetensors files, counted from their headers (no weights read): a
    packed 4-bit `qweight` holds two per byte, whatever its dtype; zero points and scales are not counted."""
    total = 0
    for name, tensor in safetensors_entries(model_dir):
        if name.endswith(_QUANTIZATION_PARTS):
            continue
        if name.endswith(".qweight"):
            begin, end = tensor["data_offsets"]
            total += 2 * (end - begin)
        else:
            total += math.prod(tensor["shape"])
    return total


def checkpoint_quantization(model_dir: Path, setting: str) -> str:
    """How the checkpoint at `model_dir` is served: "int4" for a 4-bit one (this service's or a published
    GPTQ/AWQ one), "int8" for one `quantize` wrote in INT8, else `setting` (QUANTIZATION)."""
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        return setting
    config = json.loads(config_file.read_text())
    marker = config.get(QUANTIZED_MARKER)
    if marker is not None:
        return "int4" if marker.get("format") == FORMAT_INT4 else "int8"
    published = config.get("quantization_config") or config.get("text_config", {}).get("quantization_config")
    if published and str(published.get("quant_method", "")).lower() in PUBLISHED_METHODS:
        return "int4"
    return setting


class ModelTooLarge(ValueError):
    """A checkpoint whose load would not fit the memory budget (the server refuses to start on it)."""


def check_fits(model_dir: Path, quantization: str, budget_bytes: int | None) -> None:
    """Raise ModelTooLarge, naming the bytes and the 4-bit command that would fit, if loading the
    unquantized checkpoint at `model_dir` as `quantization` (fp32, or int8: quantized at load) would need
    more than `budget_bytes` at its peak. A checkpoint `quantize` wrote is not checked here: its weights
    are read in their final layout, and mapped from the file when they do not fit (service/quant/loader.py)."""
    if budget_bytes is None:
        return
    parameters = checkpoint_parameters(model_dir)
    steady, peak = BYTES_PER_PARAMETER[quantization]
    need = int(parameters * peak)  # the weights alone: the runtime's own memory comes on top
    if need <= budget_bytes:
        return
    count = f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else f"{parameters / 1e6:.2f} M"
    how = "quantized at load to INT8" if quantization == "int8" else "in fp32"
    raise ModelTooLarge(
        f"{model_dir} holds {count} parameters: served {how} its weights need about {need / GIB:.1f} GiB while "
        f"loading ({parameters * steady / GIB:.1f} GiB after), more than the memory budget of "
        f"{budget_bytes / GIB:.2f} GiB (MAX_MEMORY_MB, or the machine's memory less a margin). Write a 4-bit "
        f"checkpoint once (weights of about {parameters * INT4_BYTES_PER_WEIGHT / GIB:.1f} GiB, read in their final "
        f"layout and from the file when memory is short): python -m service quantize --bits 4 {model_dir} "
        f"{model_dir}-int4, and set MODEL_PATH to it"
    )
