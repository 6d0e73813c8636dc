"""Writing a quantized checkpoint (`python -m service quantize SRC DST`, `make-model --bits`): every
Linear INT8 or 4-bit, one block of the model at a time, each tensor read on its own and quantized in
row chunks, so the whole fp32 model never exists. A GPTQ or AWQ checkpoint converts exactly.

The checkpoint (format 2; service/quant/packing.py names its tensors) holds:
  config.json             SRC's config plus QUANTIZED_MARKER (how it was made, and its files)
  int8-NNNNN.safetensors  every Linear as the model computes it (q/k/v and gate/up fused; a mixture of experts'
                          experts as `<layer>.mlp.experts.gate_up.<e>` and `.down.<e>`): INT8 ones as
                          `<name>.packed` (int8, the native kernel's layout, the same on every CPU),
                          `.column_sums` int32 [out], `.weight_scale` fp32 [out] (zero point 0), `.packed_shape`
                          [out, in], `.bias` fp32; 4-bit ones in the 4-bit kernel's layout (int4_linear.py)
  resident.safetensors    the embedding as int8 rows + `weight_scale` (unless it is the tied INT8 lm_head's),
                          and every other (small) tensor in fp32
  every other file of SRC (tokenizer, chat template, preprocessor and generation configs), copied
Serving maps every file and computes from it in place (service/quant/loader.py). Its `Int8Linear`s
are those quantizing at load time makes (service/quant/in_place.py), so both answer exactly alike.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from ..memory import MIB, release_memory, unmapped_large_blocks
from . import packing, published
from .fusion import is_moe_block
from .int4_linear import GROUP_SIZES, dequantize, group_for, pack, quantize_groups
from .int8_linear import quantize_rows, rows_per_chunk
from .packing import FORMAT, FORMAT_INT4, FORMAT_VERSION, INT4_SHAPE, QUANTIZED_MARKER, SCALE, linear_groups
from .source_tensors import SourceTensors
from .structure import embedding_name, linear_names, quantization_blocks, skeleton

log = logging.getLogger(__name__)

RESIDENT_FILE = "resident.safetensors"
SHARD_BYTES = 256 * MIB  # the writer holds at most about one shard of output in memory
BITS = (8, 4)
GROUP_SIZE = 128  # `--bits 4`'s default group (bench/bench_int4.py measures the others' error, bytes and speed)
KEEP_8BIT = ("model.visual.",)  # `--bits 4`'s default: Linears (name prefixes) that stay INT8


class ShardWriter:
    def __init__(self, dst: Path, limit: int):
        self.dst, self.limit = dst, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[str] = []

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        if sum(t.numel() * t.element_size() for t in self.pending.values()) >= self.limit:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            name = f"int8-{len(self.files) + 1:05d}.safetensors"
            packing.write_aligned_safetensors(self.pending, self.dst / name)
            self.files.append(name)
            self.pending = {}
            release_memory()


def _in_row_chunks(source, name: str, quantize):
    """`quantize` (a per-row quantization: each row's result depends on that row alone) applied to
    `rows_per_chunk` rows of the tensor `name` at a time, its outputs concatenated: the same tensors as
    quantizing the whole, with only a chunk of the source in memory."""
    shape = source.shape(name)
    step = rows_per_chunk(shape)
    pieces = [quantize(source.read_rows(name, start, start + step)) for start in range(0, shape[0], step)]
    return pieces[0] if len(pieces) == 1 else tuple(torch.cat(parts) for parts in zip(*pieces))


def _quantized_linear(source: SourceTensors, name: str, weight_name: str, has_bias: bool) -> dict:
    rows, scales = _in_row_chunks(source, weight_name, quantize_rows)
    out = {f"{name}.weight": rows, f"{name}{SCALE}": scales}
    if has_bias:
        out[f"{name}.bias"] = source.read([f"{name}.bias"])[f"{name}.bias"].to(torch.float32, copy=True)
    return out


def _fused_int8(name: str, parts: list[str], pieces: list[dict], has_bias: bool) -> dict:
    """The checkpoint Linears `parts` (their INT8 tensors, `pieces`) as the one model Linear `name`,
    rows side by side, in the native kernel's layout (format 2)."""
    rows = torch.cat([t[f"{p}.weight"] for p, t in zip(parts, pieces)])
    scales = torch.cat([t[f"{p}{SCALE}"] for p, t in zip(parts, pieces)])
    bias = torch.cat([t[f"{p}.bias"] for p, t in zip(parts, pieces)]) if has_bias else None
    return packing.native_int8_tensors(name, rows, scales, bias)


def _four_bit(
    source: SourceTensors, scheme: dict | None, name: str, parts: list[str], weight_names: list[str], spec: dict
) -> dict | None:
    """The 4-bit tensors of the model Linear `name` (the checkpoint Linears `parts`, fused in order), or
    None when it stays INT8: a published 4-bit Linear converts exactly; an unquantized one is
    quantized in groups (int4_linear.group_for) unless `spec["keep_8bit"]` names it or no group fits."""
    if scheme is not None and all(p in source.published for p in parts):
        tensors = source.read([key for p in parts for key in _published_keys(source, p)])
        pieces = [published.unpack(tensors, scheme, p) for p in parts]
    elif scheme is not None or spec["bits"] != 4 or name.startswith(spec["keep_8bit"]):
        return None  # (a published checkpoint's unquantized Linears were left so by its publisher: INT8)
    else:
        group = group_for(source.shape(weight_names[0])[1], spec["group_size"])
        if group is None:
            return None
        pieces = [
            _in_row_chunks(source, w, lambda rows: quantize_groups(rows, group, spec["symmetric"]))
            for w in weight_names
        ]
    values, zeros, scales = (torch.cat([piece[i] for piece in pieces]) for i in range(3))
    group = values.shape[1] // zeros.shape[1]
    out = {f"{name}.{part}": t for part, t in pack(values, zeros, scales).items()}
    out[f"{name}{INT4_SHAPE}"] = torch.tensor([values.shape[0], values.shape[1], group], dtype=torch.int32)
    return out


EXPERT_TENSORS = ("gate_up_proj", "down_proj")  # a mixture-of-experts layer's 3-D tensors


def _expert_weights(source, prefix: str, experts: nn.Module):
    """(model Linear name, weight out × in) of each expert of one layer — `prefix.gate_up.E` (gate rows,
    then up rows) and `prefix.down.E`, service/quant/fusion.py's `ExpertLinears` — from the layer's
    3-D tensors, in transformers 5's layout or transposed as the releases store them, read one expert
    at a time (a 30B-A3B layer's gate_up tensor is 0.8 GB in bf16; one expert of it, 6 MB)."""
    if f"{prefix}.0.down_proj.weight" in source:  # an expert's own Linears (Qwen3.5-MoE's releases)
        for e in range(getattr(experts, EXPERT_TENSORS[0]).shape[0]):
            parts = source.read([f"{prefix}.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")])
            yield (
                f"{prefix}.gate_up.{e}",
                torch.cat([parts[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]),
            )
            yield f"{prefix}.down.{e}", parts[f"{prefix}.{e}.down_proj.weight"]
        return
    for tensor, part in zip(EXPERT_TENSORS, ("gate_up", "down")):
        expected = tuple(getattr(experts, tensor).shape)
        key = f"{prefix}.{tensor}"
        if key not in source:
            raise KeyError(f"{key} is missing: is it a Qwen3-VL checkpoint?")
        shape = tuple(source.shape(key))
        turned = shape != expected
        if turned and (shape[0], shape[2], shape[1]) != expected:
            raise ValueError(f"{key}: shape {shape}, {expected} expected")
        for e in range(shape[0]):
            weight = source.read_rows(key, e, e + 1)[0]
            yield f"{prefix}.{part}.{e}", weight.t() if turned else weight


PUBLISHED_EXPERT_PARTS = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def _expert_tensors(source, scheme: dict | None, prefix: str, experts: nn.Module, spec: dict):
    """(model Linear name, its tensors: 4-bit or INT8) of each expert of one layer. A published GPTQ/AWQ
    mixture of experts stores each expert as its own Linears (`prefix.E.gate_proj`, `up_proj`, `down_proj`,
    as GPTQModel, AutoAWQ and vLLM name them): those convert exactly, as the dense ones do. Otherwise the
    layer's 3-D tensors are quantized an expert at a time (`spec`: 4-bit where it says so, else INT8)."""
    if scheme is not None and f"{prefix}.0.down_proj" in source.published:
        for e in range(getattr(experts, EXPERT_TENSORS[0]).shape[0]):
            for part, names in PUBLISHED_EXPERT_PARTS.items():
                parts = [f"{prefix}.{e}.{n}" for n in names]
                packed = _four_bit(source, scheme, f"{prefix}.{part}.{e}", parts, [], spec)
                if packed is None:
                    missing = [p for p in parts if p not in source.published]
                    raise published.UnsupportedCheckpoint(f"{missing[0]}: an expert left unquantized in a 4-bit one")
                yield f"{prefix}.{part}.{e}", packed
        return
    for expert, weight in _expert_weights(source, prefix, experts):
        packed = _four_bit_weight(weight, expert, spec)
        if packed is None:
            packed = packing.native_int8_tensors(expert, *quantize_rows(weight), None)
        yield expert, packed


def _resident_tensors(source, scheme: dict | None, names: list[str]) -> dict[str, torch.Tensor]:
    """The float tensors kept as they are (norms, the MoE router, biases), fp32. A published checkpoint
    may store the router 4-bit (AWQ quantizes `mlp.gate` too): its weight is then scale·(value − zero),
    exact in fp32 (int4_linear.dequantize), which is the matrix its publisher's kernels multiply by."""
    quantized = [n for n in names if n.endswith(".weight") and n[: -len(".weight")] in source.published]
    out = {n: t.to(torch.float32, copy=True) for n, t in source.read([n for n in names if n not in quantized]).items()}
    for n in quantized:
        linear = n[: -len(".weight")]
        out[n] = dequantize(*published.unpack(source.read(_published_keys(source, linear)), scheme, linear))
    return out


def _published_keys(source, linear: str) -> list[str]:
    """The tensors of one published 4-bit Linear in `source` (g_idx only where GPTQ stores it)."""
    return [f"{linear}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx") if f"{linear}.{t}" in source]


def _four_bit_weight(weight: torch.Tensor, name: str, spec: dict) -> dict | None:
    """The 4-bit tensors of one unquantized Linear weight, or None when it stays INT8 (as `_four_bit`)."""
    if spec["bits"] != 4 or name.startswith(spec["keep_8bit"]):
        return None
    group = group_for(weight.shape[1], spec["group_size"])
    if group is None:
        return None
    values, zeros, scales = quantize_groups(weight, group, spec["symmetric"])
    out = {f"{name}.{part}": t for part, t in pack(values, zeros, scales).items()}
    out[f"{name}{INT4_SHAPE}"] = torch.tensor([values.shape[0], values.shape[1], group], dtype=torch.int32)
    return out


def write_quantized(
    src: str | Path,
    dst: str | Path,
    progress: bool = True,
    bits: int = 8,
    group_size: int = GROUP_SIZE,
    symmetric: bool = False,
    keep_8bit: tuple[str, ...] = KEEP_8BIT,
) -> Path:
    """Write a quantized checkpoint of the Qwen3-VL checkpoint `src` to `dst`, one block at a time.

    bits=8: every Linear INT8. bits=4: the Linears 4-bit in groups of `group_size` inputs (a smaller
    group where that does not divide a Linear's inputs; asymmetric unless `symmetric`), except those
    whose names start with one of `keep_8bit` (and any no group divides), which stay INT8. A GPTQ or
    AWQ `src` converts exactly: its 4-bit Linears keep their values, its unquantized ones (vision
    tower, lm_head) become INT8.
    Each tensor is read on its own from SRC's safetensors (an expert at a time) and quantized in row
    chunks, and freed memory goes back to the OS after every block, so the whole fp32 model never exists.
    """
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    spec = quantization_spec(bits, group_size, symmetric, keep_8bit)
    config_dict = json.loads((src / "config.json").read_text())
    if config_dict.get(QUANTIZED_MARKER):
        raise ValueError(f"{src} is already a checkpoint written by `python -m service quantize`")
    scheme = published.scheme(config_dict)
    if scheme is not None and bits != 4:
        raise ValueError(f"{src} is a {scheme['quant_method'].upper()} 4-bit checkpoint: convert it with --bits 4")
    check_empty(dst)
    config = AutoConfig.from_pretrained(src)
    if scheme is not None:  # transformers would try to set up GPTQ/AWQ kernels from it; the skeleton needs none
        for holder in (config, getattr(config, "text_config", None)):
            if holder is not None and hasattr(holder, "quantization_config"):
                delattr(holder, "quantization_config")
    dst.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    marker = write_quantized_tensors(
        SourceTensors(src),
        config,
        dst,
        spec,
        made_by="python -m service quantize" + (" --bits 4" if bits == 4 else ""),
        source_path=str(src.resolve()),
        source_dtype=str(config_dict.get("dtype") or config_dict.get("torch_dtype")),
        scheme=scheme,
        progress=progress,
    )
    for file in src.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(file, dst / file.name)
    config_dict.pop("quantization_config", None)
    config_dict.get("text_config", {}).pop("quantization_config", None)
    write_config(dst, config_dict, marker)
    log.info("wrote %d-bit checkpoint %s from %s in %.1f s", bits, dst, src, time.perf_counter() - start)
    return dst


def quantization_spec(bits: int, group_size: int, symmetric: bool, keep_8bit: tuple[str, ...]) -> dict:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}")
    return {"bits": bits, "group_size": group_size, "symmetric": symmetric, "keep_8bit": tuple(keep_8bit)}


def check_empty(dst: Path) -> None:
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")


def write_config(dst: Path, config_dict: dict, marker: dict) -> None:
    """config.json with the QUANTIZED_MARKER entry — written last: a half-written directory has none,
    so it cannot be mistaken for a checkpoint."""
    config_dict[QUANTIZED_MARKER] = marker
    (dst / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")


class _Counted:
    """A tensor source whose reads advance a progress bar by their bytes."""

    def __init__(self, source, bar):
        self.source, self.bar = source, bar

    def __getattr__(self, name):
        return getattr(self.source, name)

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = self.source.read(names)
        self.bar.update(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        out = self.source.read_rows(name, start, stop)
        self.bar.update(out.numel() * out.element_size())
        return out


@unmapped_large_blocks()  # its tensors freed back to the OS as they go: see that function
def write_quantized_tensors(
    source,
    config,
    dst: Path,
    spec: dict,
    made_by: str,
    source_path: str,
    source_dtype: str,
    scheme: dict | None = None,
    progress: bool = True,
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """Quantize every tensor `source` gives (a checkpoint on disk, or random weights generated tensor
    by tensor: service/random_checkpoints/random_weights.py) into `dst`'s int8-NNNNN and resident safetensors, one
    block of the model at a time; returns the QUANTIZED_MARKER entry. What is in memory at once: one
    source tensor (an expert at a time for a mixture of experts), its quantization's row chunk, and
    at most about `shard_bytes` of output."""
    from tqdm import tqdm

    bits = spec["bits"]
    model = skeleton(config)
    if getattr(model, "mtp", None) is not None and "mtp.fc.weight" not in source:
        model.mtp = None  # a copy without its multi-token prediction head: written without it
    embed_name = embedding_name(model)
    tied = f"{embed_name}.weight" if bool(getattr(config, "tie_word_embeddings", False)) else None
    shards = ShardWriter(dst, shard_bytes)
    linear_params: set[str] = set()
    embedding_in_lm_head = False
    embedding: dict[str, torch.Tensor] = {}
    four_bit: list[str] = []  # model Linears written 4-bit (fused where the model fuses)
    four_bit_parts = 0  # the checkpoint Linears they replace
    expert_int8 = 0  # experts' Linears written INT8
    bar = tqdm(
        total=source.nbytes(),
        desc="quantizing",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not progress,
    )
    source = _Counted(source, bar)
    for name, block in quantization_blocks(model):
        linears = {n: model.get_submodule(n) for n in linear_names(name, block)}
        for fused, parts in linear_groups(list(linears)).items():
            weight_names = [
                tied if (p == "lm_head" and tied and f"{p}.weight" not in source) else f"{p}.weight" for p in parts
            ]  # tied lm_head: SRC stores the embedding only
            has_bias = linears[parts[0]].bias is not None
            packed = _four_bit(source, scheme, fused, parts, weight_names, spec)
            if packed is not None:
                if has_bias:
                    biases = source.read([f"{p}.bias" for p in parts])
                    packed[f"{fused}.bias"] = torch.cat([biases[f"{p}.bias"].float() for p in parts])
                shards.add(packed)
                four_bit.append(fused)
                four_bit_parts += len(parts)
            else:
                pieces = []
                for part, weight_name in zip(parts, weight_names):
                    if part in source.published:
                        raise published.UnsupportedCheckpoint(f"{part}: a 4-bit Linear this service cannot keep 4-bit")
                    pieces.append(_quantized_linear(source, part, weight_name, has_bias))
                    embedding_in_lm_head |= part == "lm_head" and weight_name == tied
                shards.add(_fused_int8(fused, parts, pieces, has_bias))
                del pieces
            linear_params.update(f"{p}.{t}" for p in parts for t in ("weight", "bias"))
        mlp = getattr(block, "mlp", None)
        if mlp is not None and is_moe_block(mlp):
            for expert, packed in _expert_tensors(source, scheme, f"{name}.mlp.experts", mlp.experts, spec):
                if f"{expert}.qweight" in packed:
                    four_bit.append(expert)
                else:
                    expert_int8 += 1
                shards.add(packed)
                del packed
            linear_params.update(f"{name}.mlp.experts.{t}" for t in EXPERT_TENSORS)
        release_memory()
    shards.flush()
    if not embedding_in_lm_head:  # (tied to an INT8 lm_head, the embedding is its packed rows)
        rows, scales = _in_row_chunks(source, f"{embed_name}.weight", quantize_rows)
        embedding = {f"{embed_name}.weight": rows, f"{embed_name}{SCALE}": scales}
    rest = [n for n, _ in model.named_parameters() if n not in linear_params and not n.startswith(embed_name + ".")]
    resident = _resident_tensors(source, scheme, rest)
    packing.write_aligned_safetensors({**embedding, **resident}, dst / RESIDENT_FILE)
    bar.close()
    del embedding, resident
    release_memory(full=True)
    marker = _marker(made_by, source_path, source_dtype, spec, scheme, tied, shards.files)
    if bits == 4:
        marker.update(
            int4_linears=len(four_bit),
            int8_linears=sum(1 for n in linear_params if n.endswith(".weight")) - four_bit_parts + expert_int8,
        )
    return marker


def _marker(
    made_by: str, source: str, source_dtype: str, spec: dict, scheme: dict | None, tied, shards: list[str]
) -> dict:
    """The QUANTIZED_MARKER entry: how the checkpoint was made, from what, and its files."""
    bits = spec["bits"]
    marker = {
        "format": FORMAT_INT4 if bits == 4 else FORMAT,
        "version": FORMAT_VERSION,
        "weights": "int8, symmetric per output channel (torch per_channel_dynamic_qconfig), zero point 0",
        "activations": "quantized at run time, per token (service/quant/int8_linear.py)",
        "embedding": "int8 rows with per-row scales" + (" = the tied lm_head's INT8 weight" if tied else ""),
        "int8_layout": "native: q/k/v and gate/up fused, [out/32][in/4][32][4] (service/native/int8_gemm.c)",
        "other_tensors": "float32",
        "made_by": made_by,
        "source": source,
        "source_dtype": source_dtype,
        "torch": torch.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "linear_shards": shards,
        "resident": RESIDENT_FILE,
    }
    if bits == 4:
        marker.update(
            weights="4-bit: unsigned values with a zero point and an fp16 scale per group of inputs "
            "(service/quant/int4_linear.py), in the kernel's packed layout; those under `keep_8bit` (and any "
            "whose inputs do not split into groups) INT8",
            source_quantization=scheme["quant_method"] if scheme else None,
            group_size=None if scheme else spec["group_size"],
            symmetric=None if scheme else spec["symmetric"],
            keep_8bit=list(spec["keep_8bit"]),
        )
    return marker
