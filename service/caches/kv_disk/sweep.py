"""The disk tier's budget (KV_DISK_MB): the block files counted and, over the budget, the least
recently used removed (a hit refreshes a file's time) — under a lock file, so that two instances do
not both evict. The same sweep removes what a crashed writer left and whatever stands under a
block's name that is not a regular file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ... import metrics
from .block_files import kind_of, remove_entry

log = logging.getLogger(__package__)  # the tier's one logger, named as its package

EVICT_TO = 0.9  # of the budget, once over it
SCAN_EVERY = 0.05  # of the budget written between two scans of the folder (other instances write too)
STALE_TEMPORARY_SECONDS = 3600.0  # a writer's unfinished file older than this was left by a crash


STORED = (".kv", ".state")  # blocks of keys and values, a hybrid model's recurrent states (states.py)


def held_bytes(root: Path) -> int:
    """Bytes of the block and state files under `root` now."""
    return sum(_size(p) for suffix in STORED for p in Path(root).glob(f"*/*{suffix}"))


def default_budget_bytes(root: Path, held: int = 0) -> int:
    """A quarter of the disk's free space, the store's own files counted as free, at most 64 GiB."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    return min(64 * 1024**3, (shutil.disk_usage(probe).free + held) // 4)


class Sweeper:
    """Keeps the folder `root` within `budget_bytes`; `failed(what, exc)` hears of a lock file that
    cannot be opened. Its counts are the writer thread's."""

    def __init__(self, root: Path, budget_bytes: int, cache_name: str, failed: Callable[[str, OSError], None]):
        self.root, self.budget_bytes, self.cache_name, self.failed = Path(root), budget_bytes, cache_name, failed
        self.written_since_scan = 0
        self.held = 0  # bytes of the files at the last scan, plus this instance's writes since

    def wrote(self, nbytes: int) -> None:
        self.written_since_scan += nbytes
        self.held += nbytes

    def due(self) -> bool:
        """Whether to scan now: over the budget, or SCAN_EVERY of it written since the last scan."""
        return self.held > self.budget_bytes or self.written_since_scan > self.budget_bytes * SCAN_EVERY

    def scan(self) -> None:
        """Sum the files; over the budget, remove the least recently used down to EVICT_TO of it, and
        any temporary file a crashed writer left. One instance at a time (the others skip). Under a
        block's name, what is not a regular file is removed when that touches nothing else; what is
        not named like a block or a temporary is left alone."""
        self.written_since_scan = 0
        try:
            lock = os.open(self.root / ".lock", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self.failed("its lock file (files not counted)", exc)
            return
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            total = self._evict(self._block_files())
            self.held = total
            metrics.KV_DISK_BYTES.set(total)
        finally:
            os.close(lock)

    def _block_files(self) -> list[tuple[float, int, str]]:
        """(time, size, path) of each block file; stale temporaries and non-files under block names go."""
        files, now = [], time.time()
        try:
            folders = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except OSError as exc:
            log.warning("KV disk tier: cannot list %s: %s", self.root, exc)
            return files
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path))
            except OSError:
                continue
            for entry in entries:
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                kind = kind_of(stat.st_mode)
                if entry.name.startswith(".tmp-"):
                    if now - stat.st_mtime > STALE_TEMPORARY_SECONDS:
                        remove_entry(Path(entry.path))
                elif not entry.name.endswith(STORED):
                    continue
                elif kind is None:
                    files.append((stat.st_mtime, stat.st_size, entry.path))
                elif remove_entry(Path(entry.path)):
                    log.warning("KV disk tier: removed %s (a %s, not a block)", entry.path, kind)
        return files

    def _evict(self, files: list[tuple[float, int, str]]) -> int:
        """Over the budget, remove the least recently used files down to EVICT_TO of it; the bytes left."""
        total = sum(size for _, size, _ in files)
        if total > self.budget_bytes:
            files.sort()
            for _, size, path in files:
                if total <= self.budget_bytes * EVICT_TO:
                    break
                remove_entry(Path(path))
                total -= size
                metrics.CACHE_EVICTIONS.labels(cache=self.cache_name, reason="bytes").inc()
        return total


def _size(path: Path) -> int:
    """A block file's size; 0 if it is gone (another instance's eviction) or not a regular file."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return 0
    return status.st_size if kind_of(status.st_mode) is None else 0
