"""Checkpoints converted once into CACHE_DIR/converted before they load: a format-1 quantized one
(int8 rows of the checkpoint's unfused Linears, packed at every start) into format 2
(`current_format`), a published GPTQ or AWQ one exactly into this service's 4-bit format
(`published_checkpoint`). Keyed by the source files' names, sizes and times; instances starting
together convert once, under a lock.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from . import packing, published
from .packing import FORMAT_VERSION, FORMATS, QUANTIZED_MARKER, SCALE, int4_names, linear_groups, quantized_marker
from .writer import SHARD_BYTES, ShardWriter, write_quantized

log = logging.getLogger(__name__)


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
    shards = ShardWriter(dst, SHARD_BYTES)
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
