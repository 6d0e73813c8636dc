"""`python -m service quantize SRC DST` as a user runs it: wall time and the process's peak RSS."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.core import ROOT
from bench.core.harness import GIB
from bench.core.results import markdown_table


def measure(source: Path, destination: Path) -> dict:
    """Quantize `source` into `destination` (replaced) in a child process; its time and peak RSS."""
    if destination.exists():
        shutil.rmtree(destination)
    env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
    t0 = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "service", "--log-level", "WARNING", "quantize", str(source), str(destination)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - t0
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"quantize failed with exit code {child.returncode}")
    size = sum(f.stat().st_size for f in destination.iterdir())
    return {
        "seconds": seconds,
        "peak_rss_gib": usage.ru_maxrss * 1024 / GIB,
        "size_gib": size / GIB,
        "source_gib": sum(f.stat().st_size for f in source.glob("*.safetensors")) / GIB,
    }


def table(r: dict) -> str:
    return markdown_table(
        ["", "value"],
        [
            ["source safetensors (GiB)", f"{r['source_gib']:.2f}"],
            ["INT8 checkpoint (GiB)", f"{r['size_gib']:.2f}"],
            ["quantize wall time (s)", f"{r['seconds']:.1f}"],
            ["peak RSS of quantize (GiB)", f"{r['peak_rss_gib']:.2f}"],
        ],
    )
