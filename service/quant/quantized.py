"""INT8 weights: quantizing a model in place, and pre-quantized checkpoints that load without fp32 weights.

Both paths make the same `Int8Linear`s (service/quant/int8_linear.py: int8 weights symmetric per output
channel, activations quantized per token at run time; q/k/v and gate/up fused), so a pre-quantized
checkpoint answers exactly like quantizing at load time. The input embedding is int8 rows with
per-row scales — for Qwen3-VL's tied embeddings the lm_head's own INT8 weight — dequantized on lookup.

A checkpoint written by `python -m service quantize SRC DST` (format 2) holds:
  config.json             SRC's config plus QUANTIZED_MARKER (how it was made, and its files)
  int8-NNNNN.safetensors  every Linear as the model computes it (q/k/v and gate/up fused; a mixture of experts'
                          experts as `<layer>.mlp.experts.gate_up.<e>` and `.down.<e>`): INT8 ones as
                          `<name>.packed` (int8, the native kernel's layout, the same on every CPU),
                          `.column_sums` int32 [out], `.weight_scale` fp32 [out] (zero point 0), `.packed_shape`
                          [out, in], `.bias` fp32; 4-bit ones in the 4-bit kernel's layout (int4_linear.py)
  resident.safetensors    the embedding as int8 rows + `weight_scale` (unless it is the tied INT8 lm_head's),
                          and every other (small) tensor in fp32
  every other file of SRC (tokenizer, chat template, preprocessor and generation configs), copied
Serving maps every file and computes from it in place (`load_quantized`). Format 1 (int8 rows of SRC's
unfused Linears, packed at every start) is converted once into CACHE_DIR (`current_format`).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from ..memory import MIB, MemoryGuard, release_memory
from . import packing, published
from .fusion import is_moe_block, model_class
from .int4_linear import GROUP_SIZES, dequantize, group_for, pack, quantize_groups
from .int8_linear import Int8Embedding, Int8Linear, MappedInt8Linear, quantize_rows
from .packing import (
    COLUMN_SUMS,
    FORMAT,
    FORMAT_INT4,
    FORMAT_VERSION,
    FORMATS,
    INT4_SHAPE,
    PACKED,
    PACKED_SHAPE,
    QUANTIZED_MARKER,
    SCALE,
    int4_linear,
    int4_names,
    kernel_of,
    linear_bytes,
    linear_groups,
    quantized_marker,
)

log = logging.getLogger(__name__)

RESIDENT_FILE = "resident.safetensors"
SHARD_BYTES = 256 * MIB  # the writer holds at most about one shard of output in memory
BITS = (8, 4)
GROUP_SIZE = 128  # `--bits 4`'s default group (bench/bench_int4.py measures the others' error, bytes and speed)
KEEP_8BIT = ("model.visual.",)  # `--bits 4`'s default: Linears (name prefixes) that stay INT8


# -- the model's structure ------------------------------------------------------------------


def quantization_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each unit quantized at once: vision blocks, mergers, decoder layers, lm_head."""
    names = {id(m): n for n, m in model.named_modules()}
    visual = model.model.visual
    blocks = [
        *visual.blocks,
        visual.merger,
        *getattr(visual, "deepstack_merger_list", []),
        *model.model.language_model.layers,
        model.lm_head,
    ]
    return [(names[id(b)], b) for b in blocks]


def _linear_names(name: str, block: nn.Module) -> list[str]:
    return [f"{name}.{n}" if n else name for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def _embedding_name(model: nn.Module) -> str:
    embed = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is embed)


def _replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def _set_tensor(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    parent, _, attr = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    if attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device (no memory) and real rotary buffers."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return model_class(config)(config)


def quantize_in_place(
    model: nn.Module, activations: str = "per_token", int8_embedding: bool = True, kernel="fbgemm"
) -> None:
    """INT8-quantize every nn.Linear (`Int8Linear`) one block at a time (at most one block is fp32
    at once), and turn the embedding into int8 rows (the lm_head's when tied). The defaults are
    what the service and `quantize` use; the other choices exist for the fidelity benchmark."""
    embed_name = _embedding_name(model)
    embed = model.get_submodule(embed_name)
    tied = model.lm_head.weight is embed.weight
    table = None
    for name, block in quantization_blocks(model):
        block.float()
        for linear in _linear_names(name, block):
            module = model.get_submodule(linear)
            rows, scales = quantize_rows(module.weight.detach())
            if linear == "lm_head" and tied and int8_embedding:  # the same int8 rows serve as the embedding
                table = Int8Embedding(rows, scales, embed.padding_idx)
            _replace_module(
                model, linear, Int8Linear(rows, scales, module.bias, activations, kernel_of(linear, kernel))
            )
        release_memory()
    if int8_embedding:
        _replace_module(model, embed_name, table or Int8Embedding(*quantize_rows(embed.weight), embed.padding_idx))
    release_memory(full=True)


# -- writing --------------------------------------------------------------------------------


class _SourceTensors:
    """Per-tensor reads from a checkpoint's safetensors; files are opened per call, so the pages
    read are unmapped (and leave RSS) as soon as the caller drops the tensors."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.file_of = json.loads(index.read_text())["weight_map"]
        else:
            from safetensors import safe_open

            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path} has no safetensors weights")
            self.file_of = {}
            for file in files:
                with safe_open(file, "pt") as f:
                    self.file_of.update(dict.fromkeys(f.keys(), file.name))
        self.path = path
        self.published = published.quantized_linears(self.file_of)  # GPTQ/AWQ 4-bit Linears

    def shape(self, name: str) -> tuple[int, ...]:
        from safetensors import safe_open

        with safe_open(self.path / self.file_of[name], "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def nbytes(self) -> int:
        return sum((self.path / f).stat().st_size for f in set(self.file_of.values()))

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of one tensor (along its first dimension), read alone."""
        from safetensors import safe_open

        with safe_open(self.path / self.file_of[name], "pt") as f:
            return f.get_slice(name)[start:stop]

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        missing = [n for n in names if n not in self.file_of]
        if missing:
            raise KeyError(f"{self.path} lacks tensors {missing[:3]}: is it a Qwen3-VL checkpoint?")
        out = {}
        for file in sorted({self.file_of[n] for n in names}):
            with safe_open(self.path / file, "pt") as f:
                for n in names:
                    if self.file_of[n] == file:
                        out[n] = f.get_tensor(n)
        return out


class _ShardWriter:
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


READ_ROWS = 16384  # rows of a Linear read at once (the 151936 × 2048 embedding: 64 MB of bf16 at a time)


def _in_row_chunks(source, name: str, quantize):
    """`quantize` (a per-row quantization: each row's result depends on that row alone) applied to
    READ_ROWS rows of the tensor `name` at a time, its outputs concatenated: the same tensors as
    quantizing the whole, with only a chunk of the source in memory."""
    rows = source.shape(name)[0]
    pieces = [quantize(source.read_rows(name, start, start + READ_ROWS)) for start in range(0, rows, READ_ROWS)]
    return pieces[0] if len(pieces) == 1 else tuple(torch.cat(parts) for parts in zip(*pieces))


def _quantized_linear(source: _SourceTensors, name: str, weight_name: str, has_bias: bool) -> dict:
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
    source: _SourceTensors, scheme: dict | None, name: str, parts: list[str], weight_names: list[str], spec: dict
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
        _SourceTensors(src),
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
    by tensor: service/model/random_weights.py) into `dst`'s int8-NNNNN and resident safetensors, one
    block of the model at a time; returns the QUANTIZED_MARKER entry. What is in memory at once: one
    source tensor (an expert at a time for a mixture of experts), its quantization's row chunk, and
    at most about `shard_bytes` of output."""
    from tqdm import tqdm

    bits = spec["bits"]
    model = skeleton(config)
    embed_name = _embedding_name(model)
    tied = f"{embed_name}.weight" if bool(getattr(config, "tie_word_embeddings", False)) else None
    shards = _ShardWriter(dst, shard_bytes)
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
        linears = {n: model.get_submodule(n) for n in _linear_names(name, block)}
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


def estimated_bytes(
    config, bits: int | None, group_size: int = GROUP_SIZE, keep_8bit: tuple[str, ...] = KEEP_8BIT
) -> int:
    """The bytes of tensors a checkpoint of `config` holds, from its shapes alone (the model on the meta
    device): bits=None the checkpoint itself in its dtype (bf16 unless the config says otherwise);
    8 or 4 what `quantize` / `make-model --bits` write — per 4-bit weight half a byte plus a zero point
    (1 byte) and an fp16 scale per group (0.52 bytes a weight at group 128), per INT8 weight a byte
    plus a 4-byte scale per row, the embedding as int8 rows, every other tensor fp32. Files add
    their headers (a few kB each) to this."""
    model = skeleton(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    params = {n: math.prod(t.shape) for n, t in model.named_parameters(remove_duplicate=False)}
    if tied:
        params.pop("lm_head.weight", None)
    if bits is None:
        dtype = getattr(config, "dtype", None) or torch.bfloat16
        size = (dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))).itemsize
        return sum(params.values()) * size

    def four_bit(name: str, rows: int, inputs: int) -> int | None:
        group = group_for(inputs, group_size)
        if bits != 4 or name.startswith(tuple(keep_8bit)) or group is None:
            return None
        padded = -(-rows // 64) * 64  # the kernel's channel groups (int4_gemm.c)
        return padded * inputs // 2 + padded * (inputs // group) * 3 + 12

    total, counted = 0, set()
    embed_name = _embedding_name(model)
    lm_head_int8 = False
    for name, block in quantization_blocks(model):
        linears = {n: model.get_submodule(n) for n in _linear_names(name, block)}
        for fused, parts in linear_groups(list(linears)).items():
            rows = sum(linears[p].weight.shape[0] for p in parts)
            inputs = linears[parts[0]].weight.shape[1]
            bias = 4 * rows if linears[parts[0]].bias is not None else 0
            packed = four_bit(fused, rows, inputs)
            total += bias + (packed if packed is not None else _int8_bytes(rows, inputs))
            lm_head_int8 |= fused == "lm_head" and packed is None
            counted.update(f"{p}.{t}" for p in parts for t in ("weight", "bias"))
        mlp = getattr(block, "mlp", None)
        if mlp is not None and is_moe_block(mlp):
            for tensor, part in zip(EXPERT_TENSORS, ("gate_up", "down")):
                experts, rows, inputs = getattr(mlp.experts, tensor).shape
                packed = four_bit(f"{name}.mlp.experts.{part}.0", rows, inputs)
                total += experts * (packed if packed is not None else _int8_bytes(rows, inputs))
                counted.add(f"{name}.mlp.experts.{tensor}")
    vocab, hidden = model.get_submodule(embed_name).weight.shape
    if not (tied and lm_head_int8):  # else the lm_head's INT8 rows are the embedding
        total += vocab * hidden + 4 * vocab
    counted.add(f"{embed_name}.weight")
    return total + 4 * sum(n for name, n in params.items() if name not in counted)


def _int8_bytes(rows: int, inputs: int) -> int:
    """An INT8 Linear's bytes in format 2: its weights in the native layout (padded to groups of 32 rows
    and 4 inputs), a scale and a column sum per row, its shape."""
    return -(-rows // 32) * 32 * (-(-inputs // 4) * 4) + 8 * rows + 8


def published_checkpoint(path: Path, settings) -> Path:
    """`path` itself, or for a GPTQ/AWQ checkpoint its exact conversion into this service's 4-bit
    format, written once under CACHE_DIR/converted."""
    config = Path(path) / "config.json"
    if not config.is_file() or published.scheme(json.loads(config.read_text())) is None:
        return path
    return _converted_once(
        path,
        settings,
        "a published 4-bit checkpoint: converting it",
        lambda src, dst: write_quantized(src, dst, progress=False, bits=4),
    )


def current_format(path: Path, settings) -> Path:
    """`path` itself, or for a format-1 quantized checkpoint (int8 rows, packed at every start) its
    conversion into format 2 (the native kernel's layout, mapped in place), written once under
    CACHE_DIR/converted with a log line saying so."""
    marker = quantized_marker(path)
    if not marker or marker.get("format") not in FORMATS or marker.get("version") != 1:
        return path
    return _converted_once(
        path, settings, "a format-1 quantized checkpoint: converting it to format 2", _convert_format_1
    )


def _converted_once(path: Path, settings, reason: str, convert) -> Path:
    """`convert(path, dst)` run once into CACHE_DIR/converted, keyed by the source files' names, sizes
    and times; instances starting together convert it once, under a lock."""
    import fcntl
    import hashlib
    import os
    import tempfile

    files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in Path(path).iterdir() if f.is_file())
    key = hashlib.blake2b(repr((str(Path(path).resolve()), files)).encode(), digest_size=8).hexdigest()
    root = Path(settings.cache_dir) / "converted"
    dst = root / f"{Path(path).name}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{dst.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dst / "config.json").exists():
            log.warning("%s is %s (exactly) in %s, once", path, reason, dst)
            scratch = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=root))
            convert(path, scratch)
            os.replace(scratch, dst)
    return dst


def _convert_format_1(src: Path, dst: Path) -> None:
    """A format-1 checkpoint as format 2: each model Linear's int8 rows (q/k/v and gate/up side by side)
    in the native layout; 4-bit tensors, the resident file and the other files as they are."""
    from safetensors import safe_open

    marker = quantized_marker(src)
    files = {shard: safe_open(src / shard, "pt") for shard in marker["linear_shards"]}
    file_of = {key: f for f in files.values() for key in f.keys()}
    shards = _ShardWriter(dst, SHARD_BYTES)
    int8 = sorted(k[: -len(".weight")] for k in file_of if k.endswith(".weight"))
    for name, parts in linear_groups(int8).items():
        bias = [file_of[f"{p}.bias"].get_tensor(f"{p}.bias") for p in parts if f"{p}.bias" in file_of]
        rows = torch.cat([file_of[f"{p}.weight"].get_tensor(f"{p}.weight") for p in parts])
        scales = torch.cat([file_of[f"{p}{SCALE}"].get_tensor(f"{p}{SCALE}") for p in parts])
        shards.add(packing.native_int8_tensors(name, rows, scales, torch.cat(bias) if bias else None))
    for name in int4_names(file_of):
        keys = [k for k in file_of if k.startswith(f"{name}.") and k[len(name) + 1 :].count(".") == 0]
        shards.add({k: file_of[k].get_tensor(k) for k in keys})
    shards.flush()
    for file in src.iterdir():
        if file.is_file() and file.name != "config.json" and file.name not in files:
            shutil.copyfile(file, dst / file.name)
    config = json.loads((src / "config.json").read_text())
    config[QUANTIZED_MARKER].update(
        version=FORMAT_VERSION, linear_shards=shards.files, converted_from=str(src), converted_from_version=1
    )
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# -- loading --------------------------------------------------------------------------------


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
        _replace_module(model, job.name, Int8Linear(*job.args))
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
            "(the loader converts older ones once: service/quant/quantized.current_format)"
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
    embed_name = _embedding_name(model)
    padding_idx = model.get_submodule(embed_name).padding_idx
    for name in resident.keys():
        if name.endswith(SCALE):
            continue
        module_name = name.rpartition(".")[0]
        if module_name == embed_name:
            table = Int8Embedding(resident.get_tensor(name), resident.get_tensor(f"{module_name}{SCALE}"), padding_idx)
            _replace_module(model, embed_name, table)
        else:
            _set_tensor(model, name, resident.get_tensor(name))
    layouts, packing_jobs = {}, {}
    for f in (safe_open(path / shard, "pt") for shard in marker["linear_shards"]):
        keys = set(f.keys())
        for name in packing.native_int8_names(keys):
            out_features, in_features = (int(v) for v in f.get_tensor(f"{name}{PACKED_SHAPE}"))
            layout = f.get_tensor(f"{name}{PACKED}"), f.get_tensor(f"{name}{COLUMN_SUMS}")
            scales = f.get_tensor(f"{name}{SCALE}")
            bias = f.get_tensor(f"{name}.bias") if f"{name}.bias" in keys else None
            layouts[name] = layout[0], scales, in_features
            chosen = "native" if over_budget and has_native else kernel_of(name, kernel)
            later = chosen != "native" and deferred is not None and has_native and not over_budget
            if chosen == "native" or later:
                _replace_module(model, name, Int8Linear(None, scales, bias, "per_token", "native", layout, in_features))
                if later:
                    deferred.append(PendingPack(name, (None, scales, bias, "per_token", chosen, layout, in_features)))
            elif over_budget:  # no native kernel here: the weights' rows in memory after all
                rows = unpack_native(layout[0], out_features, in_features)
                _replace_module(model, name, MappedInt8Linear([(rows, scales)], bias))
            else:
                packing_jobs[name] = (None, scales, bias, "per_token", chosen, layout, in_features)
        for name in int4_names(keys):  # the 4-bit kernel computes from the stored layout as it is
            _replace_module(model, name, int4_linear(name, f.get_tensor, keys.__contains__))
    if packing_jobs:  # FBGEMM's or oneDNN's own layouts, made on `threads` threads of one OpenMP thread each
        with ThreadPoolExecutor(max(1, threads), initializer=torch.set_num_threads, initargs=(1,)) as pool:
            made = pool.map(lambda args: Int8Linear(*args), packing_jobs.values())
            for name, module in zip(packing_jobs, made):
                _replace_module(model, name, module)
    embed = model.get_submodule(embed_name)
    if isinstance(embed, nn.Embedding) and embed.weight.is_meta:
        if "lm_head" not in layouts:
            raise ValueError(f"{path} is incomplete: no embedding, and no INT8 lm_head to read it from")
        packed, scales, hidden = layouts["lm_head"]  # tied: the embedding is the lm_head's packed rows
        _replace_module(model, embed_name, PackedInt8Embedding(packed, scales, hidden, padding_idx))
    release_memory(full=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path} is incomplete: no weights for {left[:3]} (and {max(0, len(left) - 3)} more)")
    model.eval()
    model.requires_grad_(False)
    return over_budget
