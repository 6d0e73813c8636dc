"""Appending a benchmark's table to bench/RESULTS.md, headed by when, where and with what it ran."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine_line(threads: int | None = None) -> str:
    cores = len(os.sched_getaffinity(0))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    isa = [name for name in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f" {name}" in flags]
    return (f"{cpu_model()}, {cores} cores ({', '.join(isa) or 'no AVX2'}), "
            f"{threads if threads is not None else cores} threads, Python {platform.python_version()}")


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def append_section(title: str, settings: dict, body: str, threads: int | None = None) -> str:
    """Append `## title` with date, machine and settings lines, then `body`; returns the section."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    setting_text = ", ".join(f"{k}={v}" for k, v in settings.items())
    section = (f"\n## {title}\n\n{stamp} · {machine_line(threads)}\n\nSettings: {setting_text}\n\n{body}\n")
    with RESULTS.open("a") as f:
        if f.tell() == 0:
            f.write("# Benchmark results\n\nEvery section was written by the command named in it; "
                    "timings are from one run on the machine named.\n")
        f.write(section)
    print(section)
    return section
