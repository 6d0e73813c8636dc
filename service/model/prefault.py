"""Warm-up without a stall: a mapped checkpoint's pages brought into the serving process ahead of the
first requests, so they do not pay the weights' first-touch page faults one page at a time.

`madvise(MADV_WILLNEED)` starts the kernel reading the files ahead (a cold start's disk reads begin
at once, asynchronously); `madvise(MADV_POPULATE_READ)` (Linux 5.14) maps every page into this
process, as touching them would, one call per mapping, on a background thread (ctypes releases the
GIL: requests are served meanwhile). A forked worker does not inherit its master's page-table entries
of file mappings (fork skips copying them), so every serving process populates its own.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_POPULATE_READ = 22


def mapped_ranges(directory: Path) -> list[tuple[int, int]]:
    """(start, length) of this process's mappings of files under `directory`."""
    prefix, ranges = str(Path(directory).resolve()), []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].strip().startswith(prefix):
                low, high = (int(v, 16) for v in fields[0].split("-"))
                ranges.append((low, high - low))
    return ranges


def _madvise(ranges: list[tuple[int, int]], advice: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(libc.madvise(start, length, advice) == 0 for start, length in ranges)


def read_ahead(directory: Path) -> None:
    """Ask the kernel to read the mapped files of `directory` into the page cache (asynchronous)."""
    _madvise(mapped_ranges(directory), MADV_WILLNEED)


def prefault(directory: Path) -> threading.Thread | None:
    """Populate this process's mappings of `directory`'s files on a background thread (None: nothing mapped)."""
    ranges = mapped_ranges(directory)
    if not ranges:
        return None

    def run():
        started = time.perf_counter()
        if _madvise(ranges, MADV_POPULATE_READ):
            log.info(
                "mapped weights prefaulted: %.0f MiB in %.2f s",
                sum(n for _, n in ranges) / 2**20,
                time.perf_counter() - started,
            )
        else:  # an older kernel: the read-ahead at least, pages then mapped on first touch
            _madvise(ranges, MADV_WILLNEED)

    thread = threading.Thread(target=run, name="prefault", daemon=True)
    thread.start()
    return thread
