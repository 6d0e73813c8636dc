"""The service's C kernels (service/*.c), compiled once per machine with its own instruction set.

`library(source, cache_dir)` compiles `source` with gcc into CACHE_DIR/kernels (named by a digest of
the source, the flags, the compiler and the CPU, so another CPU or a changed source builds anew;
written atomically, as instances may race) and loads it with ctypes. OpenMP comes from the libgomp
torch already loaded, so the kernels share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError)  # what a missing or failing compiler raises


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def build(source: Path, cache_dir: Path, march: str = "native", flags: tuple[str, ...] = ()) -> Path:
    """The shared library of `source` for this machine (or for the instruction set `march` names,
    which tests use to run the AVX2 build on an AVX-512 CPU)."""
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    every_flag = [*FLAGS, *flags, f"-march={march}"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.blake2b(
        "\n".join([source.read_text(), " ".join(every_flag), version, _cpu_identity()]).encode(), digest_size=8
    ).hexdigest()
    target = Path(cache_dir) / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run([compiler, *every_flag, "-o", str(built), str(source)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {source.name} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    log.info("compiled %s for this CPU: %s", source.name, target)
    return target


def library(source: Path, cache_dir: Path, march: str = "native", flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source, cache_dir, march, flags)))
