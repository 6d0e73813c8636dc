"""What the INT8 suite's scenarios share (bench_quantize, bench_fidelity, bench_pixels; `python -m bench
all` runs the three with one command line): that command line, their sections' settings, and the source
checkpoint's pre-quantized INT8 copy — `python -m service quantize` run as a user runs it, its wall time
and peak RSS measured and reported (bench_quantize's section), when the copy is missing.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

from bench.core import ROOT, harness
from bench.core.harness import GIB
from bench.core.results import markdown_table, report


def parser(doc: str) -> argparse.ArgumentParser:
    """The suite's command line, the same for each of its scenarios (`all` passes it to every one): the
    model benchmarks' options, the INT8 copy's path, and fidelity's tokens and variants."""
    p = harness.parser(doc, quantization=False)
    p.add_argument("--int8-path", type=Path, help="the source's pre-quantized copy (default: <model-path>-int8)")
    p.add_argument("--fidelity-tokens", type=int, default=16)
    p.add_argument(
        "--fidelity-bits",
        choices=["all", "int8", "int4"],
        default="all",
        help="fidelity: which variants (int4: the 4-bit ones beside the shipped INT8)",
    )
    return p


def parse(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """`p`'s arguments: `model_path` the source checkpoint (the one the copies are made from),
    `int8_path` its INT8 copy (--int8-path, else <model-path>-int8; with --tiny, the embedded model's)."""
    args = harness.parse(p, argv, source=True)
    given = None if args.tiny else args.int8_path
    args.int8_path = (given or args.model_path.with_name(args.model_path.name + "-int8")).resolve()
    return args


def save(args, title: str, body: str, **extra) -> None:
    """The scenario's section, with the suite's settings (and `extra`)."""
    settings = {
        "weights": args.model_path.name,
        "INT8 checkpoint": args.int8_path.name,
        "THREADS": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "quantized engine": torch.backends.quantized.engine,
        **extra,
    }
    report(args, title, settings, body)


def quantize(args) -> None:
    """The source quantized into `args.int8_path` (replaced), measured: its section."""
    save(args, "INT8 quantize (`python -m service quantize`)", _table(_measure(args.model_path, args.int8_path)))


def int8_copy(args) -> Path:
    """The source's pre-quantized INT8 copy, written (and measured: `quantize`) if missing."""
    if not (args.int8_path / "config.json").exists():
        quantize(args)
    return args.int8_path


def _measure(source: Path, destination: Path) -> dict:
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


def _table(r: dict) -> str:
    return markdown_table(
        ["", "value"],
        [
            ["source safetensors (GiB)", f"{r['source_gib']:.2f}"],
            ["INT8 checkpoint (GiB)", f"{r['size_gib']:.2f}"],
            ["quantize wall time (s)", f"{r['seconds']:.1f}"],
            ["peak RSS of quantize (GiB)", f"{r['peak_rss_gib']:.2f}"],
        ],
    )
