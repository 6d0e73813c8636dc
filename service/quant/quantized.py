"""INT8 weights: quantizing a model in place, and pre-quantized checkpoints that load without fp32 weights.

Both paths make the same `Int8Linear`s (service/quant/int8_linear.py: int8 weights symmetric per output
channel, activations quantized per token at run time; q/k/v and gate/up fused, service/quant/fusion.py),
so a pre-quantized checkpoint answers exactly like quantizing at load time. The input embedding
is stored as int8 rows with per-row scales — for Qwen3-VL's tied embeddings that is the lm_head's
own INT8 weight — and dequantized on lookup.

A checkpoint written by `python -m service quantize SRC DST` holds:
  config.json             SRC's config plus QUANTIZED_MARKER (how it was made, and its files)
  int8-NNNNN.safetensors  every nn.Linear of SRC (unfused): `<name>.weight` int8 [out, in], `<name>.weight_scale`
                          fp32 [out] (zero point 0), `<name>.bias` fp32
  resident.safetensors    memory-mapped while serving: the embedding as int8 rows + `weight_scale`,
                          and every other (small) tensor in fp32
  every other file of SRC (tokenizer, chat template, preprocessor and generation configs), copied
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

from ..memory import MIB, MemoryGuard, release_memory
from . import packing
from .fusion import fuse_projections
from .int8_linear import Int8Embedding, Int8Linear, MappedInt8Linear, quantize_rows
from .packing import (
    FORMAT,
    FORMAT_VERSION,
    QUANTIZED_MARKER,
    SCALE,
    fused_bias,
    kernel_of,
    linear_bytes,
    linear_groups,
    quantized_marker,
)

log = logging.getLogger(__name__)

RESIDENT_FILE = "resident.safetensors"
SHARD_BYTES = 256 * MIB  # the writer holds at most about one shard of output in memory


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
    from transformers import Qwen3VLForConditionalGeneration

    with init_empty_weights(include_buffers=False):
        return Qwen3VLForConditionalGeneration(config)


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
    release_memory()


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

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

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


def _quantized_linear(source: _SourceTensors, name: str, weight_name: str, has_bias: bool) -> dict:
    tensors = source.read([weight_name] + ([f"{name}.bias"] if has_bias else []))
    rows, scales = quantize_rows(tensors[weight_name])
    out = {f"{name}.weight": rows, f"{name}{SCALE}": scales}
    if has_bias:
        out[f"{name}.bias"] = tensors[f"{name}.bias"].to(torch.float32, copy=True)
    return out


def write_quantized(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """Write an INT8 checkpoint of the Qwen3-VL checkpoint `src` to `dst`, one block at a time.

    Each tensor is read on its own from SRC's safetensors and quantized in row chunks, and freed
    memory goes back to the OS after every block, so the whole fp32 model never exists.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    config = AutoConfig.from_pretrained(src)
    if getattr(config, QUANTIZED_MARKER, None):
        raise ValueError(f"{src} is already an INT8 checkpoint")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = skeleton(config)
    source = _SourceTensors(src)
    embed_name = _embedding_name(model)
    tied = f"{embed_name}.weight" if bool(getattr(config, "tie_word_embeddings", False)) else None
    shards = _ShardWriter(dst, SHARD_BYTES)
    linear_params: set[str] = set()
    embedding: dict[str, torch.Tensor] = {}
    for name, block in tqdm(quantization_blocks(model), desc="quantizing", unit="block", disable=not progress):
        for linear in _linear_names(name, block):
            module = model.get_submodule(linear)
            weight_name = f"{linear}.weight"
            if weight_name not in source and linear == "lm_head" and tied:
                weight_name = tied  # tied lm_head: SRC stores the embedding only
            tensors = _quantized_linear(source, linear, weight_name, module.bias is not None)
            if linear == "lm_head" and weight_name == tied:
                embedding = {
                    f"{embed_name}.weight": tensors["lm_head.weight"],
                    f"{embed_name}{SCALE}": tensors[f"lm_head{SCALE}"],
                }
            shards.add(tensors)
            linear_params.update({f"{linear}.weight", f"{linear}.bias"})
        release_memory()
    shards.flush()
    if not embedding:
        rows, scales = quantize_rows(source.read([f"{embed_name}.weight"])[f"{embed_name}.weight"])
        embedding = {f"{embed_name}.weight": rows, f"{embed_name}{SCALE}": scales}
    rest = [n for n, _ in model.named_parameters() if n not in linear_params and not n.startswith(embed_name + ".")]
    resident = {n: t.to(torch.float32, copy=True) for n, t in source.read(rest).items()}
    save_file({**embedding, **resident}, dst / RESIDENT_FILE, metadata={"format": "pt"})
    del embedding, resident
    release_memory()
    for file in src.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(file, dst / file.name)
    config_dict = json.loads((src / "config.json").read_text())
    config_dict[QUANTIZED_MARKER] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "weights": "int8, symmetric per output channel (torch per_channel_dynamic_qconfig), zero point 0",
        "activations": "quantized at run time, per token (service/quant/int8_linear.py)",
        "embedding": "int8 rows with per-row scales" + (" = the tied lm_head's INT8 weight" if tied else ""),
        "other_tensors": "float32",
        "made_by": "python -m service quantize",
        "source": str(src.resolve()),
        "source_dtype": str(config_dict.get("dtype") or config_dict.get("torch_dtype")),
        "torch": torch.__version__,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "linear_shards": shards.files,
        "resident": RESIDENT_FILE,
    }
    # config.json last: a half-written directory has none, so it cannot be mistaken for a checkpoint.
    (dst / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    log.info("wrote INT8 checkpoint %s from %s in %.1f s", dst, src, time.perf_counter() - start)
    return dst


# -- loading --------------------------------------------------------------------------------


def load_quantized(
    path: Path, threads: int, memory: MemoryGuard | None = None, kernel="fbgemm"
) -> tuple[nn.Module, bool]:
    """Build the model from an INT8 checkpoint: (model, weights_mapped).

    Linear weights are read (pread) straight into int8 tensors — q/k/v and gate/up each into one —
    and packed into `Int8Linear` on `threads` threads (service/quant/packing.py); no fp32 weight is made.
    The embedding and the small tensors stay memory-mapped. If the packed weights would not fit the memory budget, the
    Linear weights stay memory-mapped too (MappedInt8Linear): the server still serves, slower.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig

    path = Path(path)
    marker = quantized_marker(path)
    if not marker or marker.get("format") != FORMAT:
        raise ValueError(f"{path} is not an INT8 checkpoint written by `python -m service quantize`")
    if marker.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{path} has INT8 format version {marker.get('version')}; this service reads "
            f"{FORMAT_VERSION}: re-run `python -m service quantize`"
        )
    config = AutoConfig.from_pretrained(path)
    model = skeleton(config)
    fuse_projections(model)
    packed_bytes = linear_bytes(path, marker)
    # Packing begun early (wsgi.py) found the weights fit; its memory now counts as used, so do not ask again.
    started = packing.claim(path, kernel)
    mapped = started is None and memory is not None and not memory.fits(packed_bytes)
    if mapped:
        log.warning(
            "the INT8 weights need %.1f MiB resident, more than MAX_MEMORY_MB leaves (%.0f MiB used of "
            "%.0f): serving them memory-mapped from %s instead. %s",
            packed_bytes / MIB,
            memory.used_bytes() / MIB,
            memory.budget_bytes / MIB,
            path,
            mapped_slowdown(threads),
        )
    # Kept open for the process's life: these tensors are views of the mapped file.
    resident = safe_open(path / marker["resident"], "pt")
    embed_name = _embedding_name(model)
    for name in resident.keys():
        if name.endswith(SCALE):
            continue
        module_name = name.rpartition(".")[0]
        if module_name == embed_name:
            padding_idx = model.get_submodule(embed_name).padding_idx
            table = Int8Embedding(resident.get_tensor(name), resident.get_tensor(f"{module_name}{SCALE}"), padding_idx)
            _replace_module(model, embed_name, table)
        else:
            _set_tensor(model, name, resident.get_tensor(name))
    if mapped:
        # Kept open for the process's life, like `resident`.
        files = {shard: safe_open(path / shard, "pt") for shard in marker["linear_shards"]}
        file_of = {key: f for f in files.values() for key in f.keys()}
        for name, parts in linear_groups(
            sorted(k[: -len(".weight")] for k in file_of if k.endswith(".weight"))
        ).items():
            tensors = [
                (file_of[f"{p}.weight"].get_tensor(f"{p}.weight"), file_of[f"{p}.weight"].get_tensor(f"{p}{SCALE}"))
                for p in parts
            ]
            bias = fused_bias(
                [file_of[f"{p}.bias"].get_tensor(f"{p}.bias") if f"{p}.bias" in file_of else None for p in parts]
            )
            _replace_module(model, name, MappedInt8Linear(tensors, bias))
    else:  # packed on `threads` threads, begun early if wsgi.py started it (service/quant/packing.py)
        work = started or packing.Packing(path, marker["linear_shards"], threads, kernel)
        for name, module in work.results().items():
            _replace_module(model, name, module)
    release_memory()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{path} is incomplete: no weights for {left[:3]} (and {max(0, len(left) - 3)} more)")
    if (path / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    model.requires_grad_(False)
    return model, mapped


def mapped_slowdown(threads: int) -> str:
    """Measure (in ~0.2 s) how much slower the memory-mapped kernel is than the packed one here."""
    torch.set_num_threads(threads)
    rows = torch.randint(-127, 128, (4096, 2048), dtype=torch.int8)
    scales = torch.full((4096,), 1e-3)
    x = torch.randn(1, 2048)
    timings = []
    for module in (Int8Linear(rows, scales, None), MappedInt8Linear([(rows, scales)], None)):
        module(x)
        t0 = time.perf_counter()
        for _ in range(20):
            module(x)
        timings.append(time.perf_counter() - t0)
    return (
        f"Expect decode about {timings[1] / timings[0]:.1f}x slower (mapped vs packed kernel, measured now), "
        "and slower still whenever the OS has to read dropped weight pages back from disk."
    )
