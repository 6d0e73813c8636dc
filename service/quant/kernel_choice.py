"""Which INT8 kernel serves: measured on this machine, on this checkpoint's shapes, not read off CPU flags.

The kernels (service/quant/int8_linear.py: FBGEMM, oneDNN, the service's own `native` one) give the same
bits, so the choice is about speed only — and they rank differently on every CPU seen so far (on an
AVX-512 EPYC without AMX FBGEMM decoded 1.6x faster than oneDNN; on a Xeon with AMX oneDNN
prefilled 2-4x faster). So at the first start on a machine each available kernel is timed on
the checkpoint's own two kinds of matrix (hidden → MLP width, MLP width → hidden):

- a decode step's row, weights read from memory (the caches are flushed before each call, as a
  step reads every layer's weights once and none stays cached);
- a prefill piece of PREFILL_CHUNK_TOKENS rows (weights in cache: that is compute).

It runs on a thread of its own (service/threads.py): its OpenMP team ends with it.

The text decoder takes the kernel with the least `decode + prefill / rows`: the time per token of a
typical turn whose prompt and answer are about as long (a picture and a question of ~250 tokens,
an answer of a paragraph or two); decode weighs most because every answer token pays it. The
vision tower, which only ever sees many rows, takes the fastest prefill. The native kernel computes
from the checkpoint's mapped bytes in place, while FBGEMM and oneDNN need weights packed into a
layout of their own by every process, in its private memory (0.4 GB per instance for 2B's vision
tower): so the native kernel serves unless another is at least NATIVE_MARGIN times as fast. A
measured FBGEMM or oneDNN choice is packed after the start (service/model/loading.warm_up: the
native kernel serves until then, the same bits); INT8_KERNEL=fbgemm|onednn|native forces one kernel
for both, packed at load.

The result is kept in CACHE_DIR/int8-kernels.json under the CPU's model and flags, the torch
version, the native kernel's source, the threads and the shapes: a restart reads it instead of
measuring again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..native import INT8_GEMM, cpu_identity
from ..threads import in_own_thread
from .int8_linear import Int8Linear, available_kernels

log = logging.getLogger(__name__)

PROBE_VERSION = 2  # bump when the measurement changes: earlier results are then measured again
RESULTS_FILE = "int8-kernels.json"
DECODE_CALLS = 3  # timed calls per matrix and kernel (the fastest counts: noise only ever adds)
PREFILL_CALLS = 3
NATIVE_MARGIN = 1.25  # how much faster a kernel that packs its own copy must be than the native one


@dataclass
class KernelChoice:
    """The kernels serving the text decoder (with lm_head) and the vision tower, and why."""

    decoder: str
    vision: str
    forced: bool = False
    cached: bool = False  # read from CACHE_DIR, not measured by this process
    probe_seconds: float = 0.0
    # kernel → {"decode_ms": one row, both matrices; "prefill_ms": PREFILL_CHUNK_TOKENS rows, both matrices}
    measured: dict[str, dict[str, float]] = field(default_factory=dict)

    def describe(self) -> str:
        if self.forced:
            return f"{self.decoder} (INT8_KERNEL)"
        figures = ", ".join(
            f"{k} {m['decode_ms']:.2f} ms/row + {m['prefill_ms']:.1f} ms/piece" for k, m in self.measured.items()
        )
        how = "measured before" if self.cached else f"measured in {self.probe_seconds:.2f} s"
        return f"decoder {self.decoder}, vision {self.vision} ({how}: {figures})"


def checkpoint_shapes(model_path: Path) -> tuple[int, int]:
    """(hidden size, MLP width) of the checkpoint's text decoder, from its config.json: an expert's
    MLP width for a mixture of experts (what a decode step mostly reads)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config", config)
    experts = text.get("num_experts") or text.get("num_local_experts")
    return int(text["hidden_size"]), int(text["moe_intermediate_size"] if experts else text["intermediate_size"])


def choose(setting: str, model_path: Path, cache_dir: Path, threads: int, rows: int) -> KernelChoice:
    """The kernels INT8_KERNEL (`setting`) names, or for "auto" the measured best (cached per machine)."""
    if setting != "auto":
        return KernelChoice(decoder=setting, vision=setting, forced=True)
    hidden, width = checkpoint_shapes(model_path)
    candidates = available_kernels()
    key = hashlib.blake2b(
        repr(
            (
                PROBE_VERSION,
                INT8_GEMM.text(),
                cpu_identity(),
                torch.__version__,
                threads,
                rows,
                hidden,
                width,
            )
            + tuple(candidates)
        ).encode(),
        digest_size=8,
    ).hexdigest()
    path = Path(cache_dir) / RESULTS_FILE
    known = _read(path)
    try:
        return _decide(known[key]["measured"], cached=True, probe_seconds=known[key]["probe_seconds"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):  # not measured here yet, or not readable
        pass
    started = time.perf_counter()
    measured = in_own_thread(lambda: _measure(candidates, hidden, width, rows), threads, "int8-kernel-probe")
    choice = _decide(measured, cached=False, probe_seconds=time.perf_counter() - started)
    _write(path, {**_read(path), key: {"measured": measured, "probe_seconds": choice.probe_seconds}})
    return choice


def _decide(measured: dict, cached: bool, probe_seconds: float) -> KernelChoice:
    def per_token(kernel):
        return measured[kernel]["decode_ms"] + measured[kernel]["prefill_ms"] / measured[kernel]["rows"]

    def fastest(cost) -> str:
        best = min(measured, key=cost)
        if "native" in measured and cost(best) * NATIVE_MARGIN > cost("native"):
            return "native"
        return best

    return KernelChoice(
        decoder=fastest(per_token),
        vision=fastest(lambda k: measured[k]["prefill_ms"]),
        cached=cached,
        probe_seconds=probe_seconds,
        measured=measured,
    )


def _flush_size() -> int:
    """Bytes to read between decode calls so that no weight is left in any cache: twice the last
    level cache (from sysfs; 64 MiB if it does not say), at most 256 MiB. A VM's sysfs may report its
    host socket's whole shared cache (480 MiB seen on a 2-core Xeon VM): flushing twice that 18 times
    made a first start's probe 1.5 s instead of 0.25, and ranked the kernels the same."""
    try:
        sizes = [Path(p).read_text().strip() for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")]
        largest = max(int(s[:-1]) * {"K": 1024, "M": 1024**2}[s[-1]] for s in sizes if s[-1] in "KM")
        return min(2 * largest, 256 * 1024**2)
    except (OSError, ValueError):
        return 64 * 1024**2


def _measure(candidates: list[str], hidden: int, width: int, rows: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    # (out, in): gate_up's and down's kinds of matrix, capped at 4-6 MB so that three kernels pack and
    # run in a fraction of a second
    shapes = [(min(2 * width, 2048), hidden), (min(hidden, 1024), width)]
    weights = [
        (torch.empty(shape, dtype=torch.int8).random_(-127, 128, generator=generator), torch.full((shape[0],), 1e-3))
        for shape in shapes
    ]
    inputs = [torch.randn(rows, shape[1], generator=generator) for shape in shapes]
    flush = torch.ones(_flush_size() // 4)
    with torch.inference_mode():
        layers = {kernel: [Int8Linear(w, s, None, kernel=kernel) for w, s in weights] for kernel in candidates}
        for kernel_layers in layers.values():
            for layer, x in zip(kernel_layers, inputs):
                layer(x[:1])  # first-call costs
        decode, prefill = {kernel: [] for kernel in candidates}, {kernel: [] for kernel in candidates}
        # The kernels take turns, a call each a round: a VM's speed moves within seconds (seen: a 2-core
        # EPYC's read bandwidth 47 or 78 GB/s a minute apart), and kernels timed one after the other had
        # one native prefill read 1.3x slow, giving a vision tower to a packed private copy (+0.33 GiB).
        for round_ in range(max(DECODE_CALLS, PREFILL_CALLS)):
            for kernel, kernel_layers in layers.items():
                if round_ < DECODE_CALLS:
                    total = 0.0
                    for layer, x in zip(kernel_layers, inputs):
                        flush.sum()
                        began = time.perf_counter()
                        layer(x[:1])
                        total += time.perf_counter() - began
                    decode[kernel].append(total)
                if round_ < PREFILL_CALLS:
                    began = time.perf_counter()
                    for layer, x in zip(kernel_layers, inputs):
                        layer(x)
                    prefill[kernel].append(time.perf_counter() - began)
        del layers
    return {
        kernel: {"decode_ms": min(decode[kernel]) * 1000, "prefill_ms": min(prefill[kernel]) * 1000, "rows": rows}
        for kernel in candidates
    }


def _read(path: Path) -> dict:
    """The kept measurements; {} for a missing or damaged file (measured over, then rewritten)."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return results if isinstance(results, dict) else {}


def _write(path: Path, results: dict) -> None:
    """Atomically (instances starting together may race: the last one wins, both are valid)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(results, indent=1))
        os.replace(scratch, path)
    except OSError as exc:
        log.warning("could not keep the INT8 kernel measurement in %s: %s", path, exc)
