"""How many service instances a machine holds, and which cores and port each one gets."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..footprint import BYTES_PER_PARAMETER, RUNTIME_BYTES, checkpoint_parameters, checkpoint_quantization
from ..memory import MIB, cgroup_memory, default_budget_bytes
from ..settings import EMBEDDED_MODEL_DIRNAME, Settings, SettingsError

log = logging.getLogger("service.deploy")

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
