"""bench/RESULTS.md: one section per scenario and machine, written only by the benchmark commands.

A section is headed `## TITLE · MACHINE · COMMAND` — what the scenario measured, the machine it ran
on ("AMX Xeon", "AVX2-only EPYC": its widest vector extension and CPU family) and the command that
runs it (`python -m bench.bench_x`) — then the exact command line, the commit it ran on, the date,
the machine in full and the settings, and — where it gives a decode figure — whether exact speculative
decoding was on (`Speculation:`; the benchmarks run with it off unless asked). Rerunning a scenario on
a machine replaces that machine's section in place (earlier runs stay in git history); a first run on
another machine goes beside the scenario's other sections. Plots go to bench/plots/, one per scenario
and machine likewise.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.core import ROOT

RESULTS = ROOT / "bench" / "RESULTS.md"
PLOTS = ROOT / "bench" / "plots"
PREAMBLE = (
    "# Benchmark results\n\nOne section per scenario and machine: the latest run there, written by the "
    "command named in it (rerunning the command on that machine replaces its section; earlier runs are in "
    "git history). Timings are from one run on the machine named. Do not edit by hand.\n"
)
COMMAND_PREFIX = "Command: `"
SPECULATION_PREFIX = "Speculation: "  # the line every section with a decode figure has
DECODE_FIGURE = re.compile(r"\btok(?:ens)?/s\b")
SPECULATION = {
    "off": "off (`SPECULATIVE=off`): every decode figure is a token a forward",
    "on": "on (`SPECULATIVE=on`): decode figures count the guesses exact speculative decoding verified, which "
    "random weights accept far more often than a real model's answers would",
}
SEPARATOR = " · "  # between a heading's title, machine and command
OUTPUTS = (":!bench/RESULTS.md", ":!bench/plots")  # pathspecs: what the benches write
WIDEST = (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2-only"))  # flag → machine name, widest first
# The line under the command: "2026-12-01 17:28 UTC · Intel(R) Xeon(R) Processor, 2 cores (avx2, ...), ..."
MACHINE_LINE = re.compile(r"^[\d-]+ [\d:]+ UTC · (?P<cpu>.+?), \d+ cores \((?P<isa>[^)]*)\)", re.M)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def instruction_sets() -> list[str]:
    """Which of AVX2, AVX-512 (F, VNNI) and AMX this CPU has, by their /proc/cpuinfo flags."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return [name for name in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f" {name}" in flags]


def machine_line(threads: int | None = None) -> str:
    cores = len(os.sched_getaffinity(0))
    return (
        f"{cpu_model()}, {cores} cores ({', '.join(instruction_sets()) or 'no AVX2'}), "
        f"{threads if threads is not None else cores} threads, Python {platform.python_version()}"
    )


def machine_name(cpu: str, isa: list[str]) -> str:
    """The machine as a heading names it: its widest vector extension, then the CPU's family
    ("Intel(R) Xeon(R) Processor" with AMX: "AMX Xeon"; "AMD EPYC" with AVX2 alone: "AVX2-only EPYC")."""
    widest = next((name for flag, name in WIDEST if flag in isa), "no-AVX2")
    family = re.sub(r"\((?:R|TM)\)|\b(?:Intel|AMD|Processor|CPU)\b|@.*", " ", cpu).split() or ["CPU"]
    return " ".join([widest, *family])


def this_machine() -> str:
    return machine_name(cpu_model(), instruction_sets())


def machine_of(section: str) -> str | None:
    """The machine a section's machine line names (`machine_name`), or None without one."""
    line = MACHINE_LINE.search(section)
    return line and machine_name(line["cpu"], [f.strip() for f in line["isa"].split(",")])


def commit() -> str:
    """HEAD's short hash, marked `+changes` when the tree differs from it (outside the results
    files themselves, which every bench run rewrites)."""

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no", "--", ".", *OUTPUTS) else "")


def scenario_command() -> str:
    """The program this process runs, as a user types it: `python -m bench.bench_x` (`python -m bench x`
    runs the same module as the program: see bench/__main__.py)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return shlex.join(["python", "-m", spec.name.removesuffix(".__main__")] if spec else ["python", sys.argv[0]])


def command_line() -> str:
    """How this process was started: `scenario_command` and its arguments."""
    return shlex.join([*shlex.split(scenario_command()), *sys.argv[1:]])


def plot_file(name: str, save: bool = True) -> Path:
    """Where a scenario's plot goes: bench/plots/ (NAME-MACHINE.png), one per machine as its section (in
    a temporary folder when the run is not saved)."""
    return (PLOTS if save else Path(tempfile.gettempdir())) / f"{name}-{this_machine().lower().replace(' ', '-')}.png"


def plot_link(path: Path) -> str:
    """A plot's link from bench/RESULTS.md."""
    return f"{PLOTS.name}/{path.name}"


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


def heading(title: str) -> str:
    """A section's heading: what it measured, this machine, this scenario's command."""
    return SEPARATOR.join([title, this_machine(), scenario_command()])


def section(title: str, settings: dict, body: str, threads: int | None = None, speculation: str | None = None) -> str:
    """`## heading`, the command, commit, date, machine and settings lines, the speculation line (required
    when `body` has a decode figure), then `body`."""
    if speculation is None and DECODE_FIGURE.search(body):
        raise ValueError(f"“{title}” has a decode figure: its section must say whether speculation was on")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    setting_text = ", ".join(f"{k}={v}" for k, v in settings.items())
    said = f"{SPECULATION_PREFIX}{speculation}\n\n" if speculation else ""
    return (
        f"## {heading(title)}\n\n{COMMAND_PREFIX}{command_line()}` · commit {commit()}\n\n"
        f"{stamp} · {machine_line(threads)}\n\nSettings: {setting_text}\n\n{said}{body.strip()}\n\n"
    )


def write_section(text: str) -> None:
    """Put a `section` into bench/RESULTS.md: in place of the one of its heading (the scenario's on
    this machine), else after the last section of its command, else at the end."""
    title = text.splitlines()[0][3:]
    kept = sections(RESULTS.read_text()) if RESULTS.exists() else []
    titles = [t for t, _ in kept]
    if title in titles:
        kept[titles.index(title)] = (title, text)
    else:
        command = SEPARATOR + title.rpartition(SEPARATOR)[2]
        same = [i for i, t in enumerate(titles) if t.endswith(command)]
        kept.insert(same[-1] + 1 if same else len(kept), (title, text))
    _write(kept)


def report(
    args,
    title: str,
    settings: dict,
    body: str,
    threads: int | None = None,
    save: bool | None = None,
    speculation: str | None = None,
) -> int:
    """Print the section of `title` (with the benchmark's `args.threads`, unless `threads`) and write it
    to bench/RESULTS.md, unless the benchmark's --no-save (or `save`) says not to. Its speculation line
    says `speculation`, else the benchmark's --speculative setting. 0: the benchmark's exit status."""
    if speculation is None and getattr(args, "speculative", None):
        speculation = SPECULATION[args.speculative]
    threads = threads if threads is not None else getattr(args, "threads", None)
    text = section(title, settings, body, threads, speculation)
    if save if save is not None else not args.no_save:
        write_section(text)
    print("\n" + text)
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
