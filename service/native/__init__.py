"""The service's C kernels (service/native/*.c), compiled once per machine with its own instruction set,
and `float_ops` (their float operations: norms, activations, softmax, sin/cos, float Linears, the vision
tower's attention — the same bits on every CPU).

`library(kernel)` compiles the kernel's source with gcc into CACHE_DIR/kernels (named by a digest of
the source, the flags, the compiler and the CPU, so another CPU or a changed source builds anew;
written atomically, as instances may race) and loads it with ctypes, once per process. OpenMP comes
from the libgomp torch already loaded, so the kernels share torch's thread pool. `typed_library` gives
a kernel's functions their ctypes signatures and `linear_call` mirrors the Linear kernels' call
structure, for the modules that call them. `prebuild` starts the compiles in the background at the
very start of a server (gcc runs while Python imports torch).

This package's __init__ imports nothing heavy (wsgi.py calls it before torch is imported) and nothing
of the service but its settings; `float_ops` (imported by the rooms that use it) imports torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)  # what a missing or failing compiler raises


@dataclass(frozen=True)
class Kernel:
    source: Path
    flags: tuple[str, ...] = ()
    headers: tuple[Path, ...] = ()  # included files: part of the build's key, like the source

    def text(self) -> str:
        return "\n".join(path.read_text() for path in (self.source, *self.headers))


HERE = Path(__file__).parent
SIMD = HERE / "simd.h"
# what the float kernels share: 16-float vectors, fused multiply-adds, exp, log, tanh, erf (fixed_math.h)
FIXED, FIXED_MATH = HERE / "fixed.h", HERE / "fixed_math.h"
# Every float kernel is built with -ffp-contract=off: it fuses the multiply-adds it writes, no others,
# so its bits are the same whichever instruction set -march names.
EXACT_FLOATS = ("-ffp-contract=off", "-Wno-psabi")
ATTENTION = Kernel(HERE / "attention.c", EXACT_FLOATS, (FIXED, FIXED_MATH))
# no fused multiply-adds: its float steps must round as FBGEMM's and oneDNN's do
INT8_GEMM = Kernel(HERE / "int8_gemm.c", ("-ffp-contract=off",), (SIMD,))
# its float steps are its own (nothing to match), fused where it says so: none may fuse behind its back
INT4_GEMM = Kernel(HERE / "int4_gemm.c", EXACT_FLOATS, (SIMD, FIXED, FIXED_MATH))
# a mixture of experts' router: float sums in one fixed order, so no fused multiply-adds it did not write
ROUTER = Kernel(HERE / "router.c", EXACT_FLOATS, (FIXED, FIXED_MATH))
# Qwen3.5's linear attention: the same bits on every instruction set (16-float vectors, fixed.h's exp and log)
DELTANET = Kernel(HERE / "deltanet.c", EXACT_FLOATS, (FIXED, FIXED_MATH))
# norms, activations, softmax, sin/cos, float GEMMs and the vision tower's attention (float_ops.py)
FLOAT_OPS = Kernel(HERE / "float_ops.c", EXACT_FLOATS, (FIXED, FIXED_MATH))
KERNELS = (ATTENTION, INT8_GEMM, INT4_GEMM, ROUTER, DELTANET, FLOAT_OPS)


@functools.cache
def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def target_march() -> str:
    """The instruction set the kernels are built for: this CPU's own, or NATIVE_MARCH (gcc's -march,
    e.g. x86-64-v3 = AVX2 without AVX-512: how the tests run the AVX2 code on any CPU)."""
    return os.environ.get("NATIVE_MARCH", "native")


_build_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


@functools.cache
def _compiler_version(compiler: str) -> str:
    """Part of a build's key; asked once per process (a subprocess each time otherwise)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def build(kernel: Kernel, cache_dir: Path, march: str | None = None) -> Path:
    """The shared library of `kernel` for this machine (or for the instruction set `march` names)."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    every_flag = [*FLAGS, *kernel.flags, f"-march={march or target_march()}"]
    key = hashlib.blake2b(
        "\n".join([kernel.text(), " ".join(every_flag), _compiler_version(compiler), cpu_identity()]).encode(),
        digest_size=8,
    ).hexdigest()
    target = Path(cache_dir) / "kernels" / f"{kernel.source.stem}-{key}.so"
    with _locks_lock:
        lock = _build_locks.setdefault(target, threading.Lock())
    with lock:  # a build begun by `prebuild` is waited for, not repeated
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
            built = Path(scratch) / target.name
            command = [compiler, *every_flag, f"-I{kernel.source.parent}", "-o", str(built), str(kernel.source)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"compiling {kernel.source.name} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, target)
    log.info("compiled %s for this CPU: %s", kernel.source.name, target)
    return target


_cache_dir: Path | None = None  # where this process builds its kernels (configure); None: CACHE_DIR's default
_loaded: dict[tuple, ctypes.CDLL] = {}


def configure(cache_dir: Path) -> None:
    """Build this process's kernels under `cache_dir` (the loader calls it with CACHE_DIR)."""
    global _cache_dir
    _cache_dir = Path(cache_dir)


def _process_cache_dir() -> Path:
    if _cache_dir is None:
        from ..settings import load_settings

        configure(load_settings().cache_dir)
    return _cache_dir


def library(kernel: Kernel, march: str | None = None) -> ctypes.CDLL:
    """The kernel's library for this process (built in the directory `configure` named), loaded once."""
    key = (kernel, march or target_march())
    if key not in _loaded:
        _loaded[key] = ctypes.CDLL(str(build(kernel, _process_cache_dir(), key[1])))
    return _loaded[key]


def linear_call(name: str, sizes: tuple[str, ...], weights: tuple[str, ...]) -> type[ctypes.Structure]:
    """The ctypes twin of a Linear kernel's call structure (int8_gemm.c's `Linear`, int4_gemm.c's
    `Int4Linear`), laid out as both lay theirs: the rows in (x, x_row, m), the sizes (k, n, then the
    ints `sizes` names), the pointers `weights` names, the bias (or NULL), the rows out (y, y_row)."""
    pointers = (*weights, "bias", "y")
    fields = [
        ("x", ctypes.c_void_p),
        ("x_row", ctypes.c_int64),
        *((size, ctypes.c_int) for size in ("m", "k", "n", *sizes)),
        *((pointer, ctypes.c_void_p) for pointer in pointers),
        ("y_row", ctypes.c_int64),
    ]
    return type(name, (ctypes.Structure,), {"_fields_": fields})


def typed_library(kernel: Kernel, signatures: dict[str, tuple[list, object]], march: str | None = None) -> ctypes.CDLL:
    """`library(kernel, march)` with the argument and result types of each function `signatures` names
    ({name: (argtypes, restype)}; restype None for a void function)."""
    lib = library(kernel, march)
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return lib


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def huge_pages(address: int, length: int) -> None:
    """Ask the kernel for 2 MiB pages behind [address, address + length) — its aligned inside —
    before the memory is first written: streaming weights through 4 KiB pages costs a TLB miss per
    4 KiB (measured here: a decode-step matrix read at 28.4 GB/s on 4 KiB pages, 31.8 on 2 MiB ones).
    Transparent huge pages are often on only for memory that asks (`madvise` mode); a kernel
    without them ignores the request."""
    start = (address + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    end = (address + length) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def prebuild(cache_dir: Path) -> None:
    """Compile every kernel in the background (daemon threads: gcc runs while the caller imports);
    `library` waits for a build under way. A failure here is reported where the kernel is loaded."""
    configure(cache_dir)

    def quietly(kernel):
        try:
            build(kernel, cache_dir)
        except BUILD_ERRORS:
            pass

    for kernel in KERNELS:
        threading.Thread(target=quietly, args=(kernel,), name=f"build-{kernel.source.stem}", daemon=True).start()
