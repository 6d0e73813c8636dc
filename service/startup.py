"""Where a start's seconds go: marks from the process's creation (so the interpreter and the imports
count) to serving, logged at info level once the model is ready and shown on /ready.

A preloading Gunicorn master makes the marks up to the model's load; the worker it forks inherits
them and adds its own. Pure of torch: wsgi.py imports it first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _process_started() -> float:
    """The wall-clock time this process was created: now minus its age, both from the kernel's clock
    since boot (/proc/uptime and the process's start tick; psutil's create_time adds the boot time,
    which /proc/stat gives in whole seconds: up to a second off). Now, if it cannot say."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # a timeline without its first second beats no start
        return time.time()


_STARTED = _process_started()
_marks: list[tuple[str, float]] = []
_lock = threading.Lock()


def mark(phase: str) -> None:
    """`phase` ended now."""
    with _lock:
        _marks.append((phase, time.time()))


def timeline() -> list[dict]:
    """Each phase's seconds and when it ended, in seconds from the (master) process's start."""
    with _lock:
        marks = list(_marks)
    out, previous = [], _STARTED
    for phase, at in marks:
        out.append({"phase": phase, "seconds": round(at - previous, 3), "at": round(at - _STARTED, 3)})
        previous = at
    return out


def log_timeline(what: str) -> None:
    steps = timeline()
    if steps:
        parts = ", ".join(f"{s['phase']} {s['seconds']:.1f} s" for s in steps)
        log.info("%s %.1f s after the process started: %s", what, steps[-1]["at"], parts)
