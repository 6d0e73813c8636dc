"""The memory budget (MAX_MEMORY_MB): watch the process's RSS, evict caches near the budget, refuse work over it.

The budget counts memory the OS cannot take back: RSS minus file-backed pages. Memory-mapped
weights are file-backed and clean, so the kernel drops and re-reads them under pressure instead
of killing the process; they do not count.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from .errors import Unavailable

log = logging.getLogger(__name__)

MIB = 1024 * 1024

# Evict cache entries once usage passes this share of the budget; refuse only past the budget itself.
EVICT_AT = 0.9
# With MAX_MEMORY_MB unset: the machine's memory less this margin (the OS, Nginx, the page cache
# the weights are read through), split between the instances.
MARGIN_SHARE, MIN_MARGIN = 0.10, 256 * MIB
# With the cache byte budgets unset: these shares of the room the budget leaves after loading; the
# rest is for requests in flight (their own keys and values, activations).
CONVERSATION_CACHE_SHARE, VISION_CACHE_SHARE = 0.6, 0.1

EvictCallback = Callable[[int], object]  # called with the bytes wanted back; frees what it can


def _glibc_function(name: str) -> Callable | None:
    """glibc's `name` (malloc_trim, mallopt), or None where the C library is another."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None


def _malloc_trim() -> Callable[[], None]:
    trim = _glibc_function("malloc_trim")
    if trim is None:  # nothing to trim
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


_trim = _malloc_trim()

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc header)
# glibc raises its mmap threshold to each large block freed, up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX):
# a torch process's steady state, and what `unmapped_large_blocks` leaves behind it.
GLIBC_MAX_MMAP_THRESHOLD = 32 * MIB


def _set_mmap_threshold(size: int) -> None:
    mallopt = _glibc_function("mallopt")
    if mallopt is not None:  # (another C library: its own policy)
        mallopt(M_MMAP_THRESHOLD, size)


@contextmanager
def unmapped_large_blocks(threshold: int = 2 * MIB) -> Iterator[None]:
    """Blocks of `threshold` bytes and more mapped apart, so that freeing one hands it back at once.
    For a loop of large short-lived tensors (the quantized writer's): with glibc's sliding threshold
    they land on the heap once a first large block was freed, and its fragments held the writer's
    peak at twice its working set (tests/test_random_checkpoints.py's 0.65 GB MoE: 190–260 MB against
    ~110 MB). Not lower: each mapped block is page-faulted afresh (1 MiB: +80 % time there, 2 MiB: +15 %)."""
    _set_mmap_threshold(threshold)
    try:
        yield
    finally:
        _set_mmap_threshold(GLIBC_MAX_MMAP_THRESHOLD)


def release_memory(full: bool = False) -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc keeps them otherwise). By
    default only the young generations, where what a loop just dropped lives: a full collection
    walks every object (~0.3 s with transformers imported), too slow to run per layer."""
    gc.collect() if full else gc.collect(1)
    _trim()


def unreclaimable_bytes(process: psutil.Process | None = None) -> int:
    """RSS minus file-backed and shared pages (the kernel's RssAnon): what the process (by default
    this one) would lose to the OOM killer."""
    info = (process or psutil.Process()).memory_info()
    return info.rss - getattr(info, "shared", 0)


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of this config's KV cache: every layer of Qwen3-VL, the
    full-attention ones of a hybrid model (Qwen3.5; its linear ones keep a state instead)."""
    text = getattr(config, "text_config", config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kinds = getattr(text, "layer_types", None) or []
    layers = kinds.count("full_attention") if "linear_attention" in kinds else text.num_hidden_layers
    return layers, text.num_key_value_heads, head_dim


def state_bytes(config) -> int:
    """One sequence's recurrent state, fp32, in every linear-attention layer of a hybrid model (0 for
    Qwen3-VL): each value head's key × value matrix and the convolution's last inputs."""
    text = getattr(config, "text_config", config)
    linear = (getattr(text, "layer_types", None) or []).count("linear_attention")
    if not linear:
        return 0
    heads, key_dim, value_dim = text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim
    channels = 2 * text.linear_num_key_heads * key_dim + heads * value_dim
    return 4 * linear * (heads * key_dim * value_dim + (text.linear_conv_kernel_dim - 1) * channels)


def kv_cache_bytes(config, tokens: int, bytes_per_value: int = 4, head_layers: int = 0) -> int:
    """Bytes of one sequence's cache holding `tokens` tokens (keys and values at `bytes_per_value`, of
    its attention layers and `head_layers` more: a multi-token prediction head's; a hybrid model's state
    twice: a decode step's guesses write beside the state they may fall back to)."""
    layers, heads, head_dim = kv_shape(config)
    return tokens * (layers + head_layers) * 2 * heads * head_dim * bytes_per_value + 2 * state_bytes(config)


def cgroup_memory(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup (v2 `memory.max`, else v1
    `memory.limit_in_bytes`), or None when no limit is set (or there is no cgroup to read)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:
            folder, limit_file, usage_file = root / path.lstrip("/"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            folder, limit_file, usage_file = (
                root / "memory" / path.lstrip("/"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        else:
            continue
        try:
            limit = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 2**60:  # v1 reports "no limit" as a huge number
            return int(limit), usage
    return None


def machine_memory_bytes() -> tuple[int, str]:
    """The memory this process may use and where that figure comes from: its cgroup's limit (a
    container's, a systemd unit's) when one is set below the machine's, else the machine's."""
    total = psutil.virtual_memory().total
    cgroup = cgroup_memory()
    if cgroup is not None and cgroup[0] < total:
        return cgroup[0], "cgroup limit"
    return total, "machine memory"


def default_budget_bytes(instances: int = 1) -> int:
    """A budget for each of `instances` instances on this machine (MAX_MEMORY_MB unset)."""
    memory, _ = machine_memory_bytes()
    return max(MIN_MARGIN, memory - max(MIN_MARGIN, int(memory * MARGIN_SHARE))) // max(1, instances)


class MemoryGuard:
    """Keeps the process within a memory budget.

    `check(needed)` runs before a request takes the model: past EVICT_AT of the budget it calls
    the eviction callbacks (caches register theirs) until usage is back under that mark, and if
    usage plus `needed` would still exceed the budget it raises Unavailable (HTTP 503).
    With no budget every check passes.
    """

    def __init__(self, budget_bytes: int | None, evict_callbacks: list[EvictCallback] | None = None):
        self.budget_bytes = budget_bytes
        self.evict_callbacks: list[EvictCallback] = list(evict_callbacks or [])

    @classmethod
    def from_settings(cls, settings, evict_callbacks: list[EvictCallback] | None = None) -> MemoryGuard:
        """MAX_MEMORY_MB, or (unset) the machine's memory less a margin (`default_budget_bytes`)."""
        mb = settings.max_memory_mb
        if mb:
            return cls(mb * MIB, evict_callbacks)
        memory, source = machine_memory_bytes()
        budget = default_budget_bytes()
        log.info(
            "memory budget %.0f MiB: the %s (%.0f MiB) less a margin (MAX_MEMORY_MB unset)",
            budget / MIB,
            source,
            memory / MIB,
        )
        return cls(budget, evict_callbacks)

    def room_bytes(self) -> int:
        """What is left of the budget now."""
        return max(0, self.budget_bytes - self.used_bytes()) if self.budget_bytes is not None else 0

    def used_bytes(self) -> int:
        # The process asked for each time: a guard built in Gunicorn's preloading master must measure
        # the worker it was forked into, not the master.
        return unreclaimable_bytes()

    def fits(self, extra_bytes: int) -> bool:
        """Whether `extra_bytes` more would stay within the budget (always, with no budget)."""
        return self.budget_bytes is None or self.used_bytes() + extra_bytes <= self.budget_bytes

    def check(self, needed_bytes: int = 0) -> None:
        """Evict caches if near the budget; raise Unavailable if `needed_bytes` more would not fit."""
        if self.budget_bytes is None:
            return
        used = self.used_bytes()
        target = int(self.budget_bytes * EVICT_AT)
        if used + needed_bytes > target and self.evict_callbacks:
            for callback in self.evict_callbacks:
                callback(used + needed_bytes - target)
                release_memory(full=True)
                used = self.used_bytes()
                if used + needed_bytes <= target:
                    break
            log.info("memory budget: evicted caches, now %.0f MiB of %.0f MiB", used / MIB, self.budget_bytes / MIB)
        if used + needed_bytes > self.budget_bytes:
            raise Unavailable(
                f"out of memory budget: the server uses {used / MIB:.0f} MiB of its {self.budget_bytes / MIB:.0f} "
                f"MiB (MAX_MEMORY_MB) and this request needs about {needed_bytes / MIB:.0f} MiB more "
                "(caches already evicted); retry later, shorten the request, or raise MAX_MEMORY_MB",
                code="memory_budget",
                headers={"Retry-After": "5"},
            )
