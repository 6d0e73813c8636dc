"""How many service instances a machine holds, and which cores and port each one gets."""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..memory import MIB, cgroup_memory, default_budget_bytes
from ..settings import EMBEDDED_MODEL_DIRNAME, Settings, SettingsError

log = logging.getLogger("service.deploy")

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
_QUANTIZATION_PARTS = (".qzeros", ".scales", ".g_idx", ".qshape", ".weight_scale")
RUNTIME_BYTES = 512 * 1024**2  # Python, torch, transformers, Gunicorn: resident before any weight
MIN_CACHE_BYTES = 256 * 1024**2  # caches sized by the budget (the default) get at least this room


@dataclass(frozen=True)
class Instance:
    """One Gunicorn instance: its index, the cores it is pinned to, where it listens."""

    index: int
    cores: tuple[int, ...]
    host: str
    port: int

    @property
    def address(self) -> str:
        """host:port to reach it on this machine (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"{host}:{self.port}"

    @property
    def cpu_list(self) -> str:
        """The cores as `taskset -c` wants them: "0,1"."""
        return ",".join(str(c) for c in self.cores)


def checkpoint_parameters(model_dir: Path) -> int:
    """Parameters in a checkpoint's safetensors files, counted from their headers (no weights read): a
    packed 4-bit `qweight` holds two per byte, whatever its dtype; zero points and scales are not counted."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, tensor in header.items():
            if name == "__metadata__" or name.endswith(_QUANTIZATION_PARTS):
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


def instance_bytes(settings: Settings, parameters: int, quantization: str | None = None) -> int:
    """Memory one instance needs at least: the larger of its load peak and its steady weights plus
    room for its caches (as set, or a minimum when they take a share of the budget). `quantization`:
    the checkpoint's (checkpoint_quantization), else QUANTIZATION."""
    steady, peak = BYTES_PER_PARAMETER[quantization or settings.quantization]
    caches = 0
    if settings.cache_enabled:
        kv, vision = settings.conversation_cache_max_bytes, settings.vision_cache_max_bytes
        caches = (MIN_CACHE_BYTES if kv is None else kv) + (0 if vision is None else vision)
    return RUNTIME_BYTES + int(max(parameters * peak, parameters * steady + caches))


def available_memory() -> int:
    """Bytes free for new processes: the machine's available memory, or what its cgroup limit leaves."""
    available = psutil.virtual_memory().available
    cgroup = cgroup_memory()
    return available if cgroup is None else min(available, cgroup[0] - cgroup[1])


def numa_nodes(cores: list[int]) -> list[list[int]]:
    """`cores` grouped by NUMA node (one group where the machine reports none)."""
    groups = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            listed = {c for part in (node / "cpulist").read_text().strip().split(",") if part for c in _cpu_range(part)}
        except OSError:
            continue
        group = [c for c in cores if c in listed]
        if group:
            groups.append(group)
    covered = {c for g in groups for c in g}
    rest = [c for c in cores if c not in covered]
    return groups + [rest] if rest else groups or [list(cores)]


def _cpu_range(part: str) -> range:
    low, _, high = part.partition("-")
    return range(int(low), int(high or low) + 1)


def plan_instances(
    settings: Settings, cores: list[int] | None = None, memory: int | None = None, nodes: list[list[int]] | None = None
) -> list[Instance]:
    """Split the usable cores into disjoint, contiguous sets, one per instance.

    INSTANCES=0: one instance per CORES_PER_INSTANCE cores of each NUMA node (at least one per
    node: an instance never spans nodes, its weights stay in its node's memory), and no more than
    the memory holds. Instance i listens on HOST:PORT+i."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    count = settings.instances
    if count > len(cores):
        raise SettingsError(f"INSTANCES={count} needs at least {count} cores; this process may use {len(cores)}")
    if count:
        groups = [(cores, count)]
    else:
        model_dir = settings.model_path or settings.cache_dir / EMBEDDED_MODEL_DIRNAME
        if model_dir.is_dir():
            quantization = checkpoint_quantization(model_dir, settings.quantization)
            need = instance_bytes(settings, checkpoint_parameters(model_dir), quantization)
        else:
            need = instance_bytes(settings, 0)
        memory = available_memory() if memory is None else memory
        nodes = numa_nodes(cores) if nodes is None else nodes
        per_node = [max(1, len(node) // settings.cores_per_instance) for node in nodes]
        fits = max(1, memory // need)
        if sum(per_node) > fits:  # fewer, larger instances: what the memory holds, over all the cores
            groups = [(cores, min(fits, len(cores)))]
        else:
            groups = list(zip(nodes, per_node))
        log.info(
            "%d instance(s) on %d core(s) in %d NUMA node(s), CORES_PER_INSTANCE=%d; %.1f GiB available, "
            "about %.1f GiB needed per instance",
            sum(n for _, n in groups),
            len(cores),
            len(nodes),
            settings.cores_per_instance,
            memory / 1024**3,
            need / 1024**3,
        )
    planned: list[tuple[int, ...]] = []
    for group, n in groups:
        planned += [tuple(group[i * len(group) // n : (i + 1) * len(group) // n]) for i in range(n)]
    return [Instance(i, c, settings.host, settings.port + i) for i, c in enumerate(planned)]


def instance_budget_mb(instances: int) -> int:
    """Each instance's share of the machine's memory (MAX_MEMORY_MB when the user sets none)."""
    return default_budget_bytes(instances) // MIB
