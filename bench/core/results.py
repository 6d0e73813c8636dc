"""bench/RESULTS.md: one section per scenario, written only by the benchmark commands.

Each section is headed by its title, the exact command line that wrote it, the commit it ran on,
the date, the machine and the settings. Rerunning a scenario replaces its section in place.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from bench.core import ROOT

RESULTS = ROOT / "bench" / "RESULTS.md"
PREAMBLE = (
    "# Benchmark results\n\nEvery section below was written by the command named in it (rerunning the "
    "command replaces its section); timings are from one run on the machine named. Do not edit by hand.\n"
)
COMMAND_PREFIX = "Command: `"
OUTPUTS = (":!bench/RESULTS.md", ":!bench/*.png")  # pathspecs: what the benches write


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
    return (
        f"{cpu_model()}, {cores} cores ({', '.join(isa) or 'no AVX2'}), "
        f"{threads if threads is not None else cores} threads, Python {platform.python_version()}"
    )


def commit() -> str:
    """HEAD's short hash, marked `+changes` when the tree differs from it (outside the results
    files themselves, which every bench run rewrites)."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *OUTPUTS) else "")


def command_line() -> str:
    """How this process was started, as a user would type it (`python -m bench.x ...`)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    program = ["python", "-m", spec.name.removesuffix(".__main__")] if spec else ["python", sys.argv[0]]
    return shlex.join([*program, *sys.argv[1:]])


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def sections(text: str) -> list[tuple[str, str]]:
    """(title, whole section text) of each `## ` section, in order."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(part.splitlines()[0][3:].strip(), part) for part in parts if part.startswith("## ")]


def _write(kept: list[tuple[str, str]]) -> None:
    RESULTS.write_text(PREAMBLE + "\n" + "".join(s if s.endswith("\n\n") else s.rstrip("\n") + "\n\n" for _, s in kept))


def append_section(title: str, settings: dict, body: str, threads: int | None = None) -> str:
    """Write `## title` with the command, commit, date, machine and settings lines, then `body`,
    replacing the section of that title if there is one; returns the section."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    setting_text = ", ".join(f"{k}={v}" for k, v in settings.items())
    section = (
        f"## {title}\n\n{COMMAND_PREFIX}{command_line()}` · commit {commit()}\n\n"
        f"{stamp} · {machine_line(threads)}\n\nSettings: {setting_text}\n\n{body.strip()}\n\n"
    )
    old = sections(RESULTS.read_text()) if RESULTS.exists() else []
    titles = [t for t, _ in old]
    kept = [(t, s) for t, s in old if t != title]
    at = titles.index(title) if title in titles else len(kept)
    kept.insert(min(at, len(kept)), (title, section))
    _write(kept)
    print("\n" + section)
    return section


def report(args, title: str, settings: dict, body: str, threads: int | None = None, save: bool | None = None) -> int:
    """`append_section` with the benchmark's `args.threads` (unless `threads`), or with its --no-save
    (unless `save`) only print the section. 0: the benchmark's exit status."""
    if save if save is not None else not args.no_save:
        append_section(title, settings, body, threads if threads is not None else getattr(args, "threads", None))
    else:
        print(f"\n## {title}\n\nSettings: {settings}\n\n{body.strip()}\n")
    return 0


def line_plot(path: Path, title: str, xlabel: str, ylabel: str, lines: list, xscale: str = "linear", notes=()) -> Path:
    """A small PNG of `lines` [(xs, ys, matplotlib format, label)], `notes` [(text, x, y)] written
    beside their points; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for xs, ys, fmt, label in lines:
        ax.plot(xs, ys, fmt, label=label)
    for text, x, y in notes:
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xscale(xscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def drop_sections(titles: list[str]) -> list[str]:
    """Remove the sections of these titles (scenarios a bench no longer has); the titles dropped."""
    old = sections(RESULTS.read_text())
    kept = [(t, s) for t, s in old if t not in titles]
    _write(kept)
    return [t for t, _ in old if t in titles]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="List bench/RESULTS.md's sections, or drop obsolete ones.")
    parser.add_argument("--drop", nargs="+", metavar="TITLE", help="sections to remove (a scenario that is gone)")
    args = parser.parse_args()
    if args.drop:
        print("dropped:", *drop_sections(args.drop), sep="\n  ")
    else:
        for title, _ in sections(RESULTS.read_text()):
            print(title)
