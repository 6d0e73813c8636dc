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

from ..settings import EMBEDDED_MODEL_DIRNAME, Settings, SettingsError

log = logging.getLogger("service.deploy")

# Resident bytes per parameter, (steady, peak while loading), measured on Qwen3-VL-2B (DESIGN.md).
BYTES_PER_PARAMETER = {"fp32": (4.2, 6.2), "int8": (1.8, 3.8)}
RUNTIME_BYTES = 512 * 1024**2  # Python, torch, transformers, Gunicorn: resident before any weight


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
    """Parameters in a checkpoint's safetensors files, counted from their headers (no weights read)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def instance_bytes(settings: Settings, parameters: int) -> int:
    """Memory one instance may need: the larger of its load peak and its steady weights plus full caches."""
    steady, peak = BYTES_PER_PARAMETER[settings.quantization]
    caches = settings.conversation_cache_max_bytes + settings.vision_cache_max_bytes if settings.cache_enabled else 0
    return RUNTIME_BYTES + int(max(parameters * peak, parameters * steady + caches))


def available_memory() -> int:
    """Bytes free for new processes: the machine's available memory, or a container's cgroup limit."""
    available = psutil.virtual_memory().available
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):  # no cgroup v2 memory controller: the machine's figure stands
        pass
    return available


def plan_instances(settings: Settings, cores: list[int] | None = None, memory: int | None = None) -> list[Instance]:
    """Split the usable cores into disjoint, contiguous sets, one per instance.

    INSTANCES=0 means as many instances as fit: at most one per core, and no more than the memory
    holds. Instance i listens on HOST:PORT+i."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    count = settings.instances
    if count > len(cores):
        raise SettingsError(f"INSTANCES={count} needs at least {count} cores; this process may use {len(cores)}")
    if count == 0:
        model_dir = settings.model_path or settings.cache_dir / EMBEDDED_MODEL_DIRNAME
        need = instance_bytes(settings, checkpoint_parameters(model_dir) if model_dir.is_dir() else 0)
        memory = available_memory() if memory is None else memory
        count = max(1, min(len(cores), memory // need))
        log.info("%d instance(s): %d core(s), %.1f GiB available, about %.1f GiB per instance",
                 count, len(cores), memory / 1024**3, need / 1024**3)
    return [Instance(i, tuple(cores[i * len(cores) // count:(i + 1) * len(cores) // count]), settings.host,
                     settings.port + i) for i in range(count)]
