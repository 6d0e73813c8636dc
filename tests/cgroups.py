"""A memory-limited cgroup for tests (v2 or v1, whichever this machine's own cgroup is in): start a
process inside it and read its peak usage. Needs root and a writable memory controller."""

from __future__ import annotations

import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest


def _own_memory_cgroup() -> tuple[Path, str] | None:
    """(folder of this process's memory cgroup, "v1" | "v2"), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and not controllers:  # v2: children get memory only if the parent delegates it
            folder = Path("/sys/fs/cgroup") / path.lstrip("/")
            delegated = folder / "cgroup.subtree_control"
            if delegated.exists() and "memory" in delegated.read_text().split():
                return folder, "v2"
        elif "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "v1"
    return None


class MemoryCgroup:
    def __init__(self, folder: Path, version: str):
        self.folder, self.version = folder, version

    def enter(self) -> None:
        """Move the calling process in (use as Popen's preexec_fn: it and its children are limited)."""
        (self.folder / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int:
        return int((self.folder / ("memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes")).read_text())

    def oom_kills(self) -> int:
        if self.version == "v2":
            events = dict(line.split() for line in (self.folder / "memory.events").read_text().splitlines())
            return int(events.get("oom_kill", 0))
        return int(
            dict(line.split() for line in (self.folder / "memory.oom_control").read_text().splitlines()).get(
                "oom_kill", 0
            )
        )


@contextmanager
def memory_cgroup(limit_bytes: int):
    """A new child cgroup of this process's own with `limit_bytes` of memory; removed afterwards."""
    own = _own_memory_cgroup()
    if own is None or os.geteuid() != 0:
        pytest.skip("needs root and a writable memory cgroup (v1 or v2)")
    parent, version = own
    folder = parent / f"qwen3vl-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {exc}")
    try:
        if version == "v2":
            (folder / "memory.max").write_text(str(limit_bytes))
            (folder / "memory.swap.max").write_text("0")
        else:
            (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
        yield MemoryCgroup(folder, version)
    finally:
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except OSError:  # processes still leaving
                time.sleep(0.1)
