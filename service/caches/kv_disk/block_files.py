"""What may stand under a disk-tier block's name, and how the store opens, touches and removes it.

Only a regular file is a block. Anything else under a block's name (a directory, a symbolic link, a
FIFO, a socket, a device) is never opened for reading: a FIFO would block the reader on open, a link
may point anywhere. Such an entry counts as no block; the store removes it when that touches nothing
but the name (unlink; rmdir for an empty directory) and leaves a directory that holds something.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = {
    stat.S_IFDIR: "directory",
    stat.S_IFLNK: "symbolic link",
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "device",
    stat.S_IFBLK: "device",
}


class NotABlock(OSError):
    """An entry under a block's name that is not a regular file: `kind` says what it is."""

    def __init__(self, kind: str):
        super().__init__(f"a {kind}, not a regular file")
        self.kind = kind


def kind_of(mode: int) -> str | None:
    """None for a regular file, else what the entry is ("directory", "FIFO", ...)."""
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "special file")


def entry_kind(path: Path) -> str | None:
    """What stands under `path` without opening or following it: "file", None when nothing, else
    what it is instead ("directory", "symbolic link", "FIFO", ...)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return kind_of(mode) or "file"


def open_block(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file (not followed if a link; a FIFO does not block
    the open); NotABlock otherwise, FileNotFoundError if gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise NotABlock("symbolic link") from None
        raise
    try:
        kind = kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            raise NotABlock(kind)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def remove_entry(path: Path) -> bool:
    """Remove the name `path` — a file, a link (not what it points to), a FIFO, a socket, an empty
    directory; a directory that holds something is left. Whether nothing stands there now."""
    try:
        path.unlink()
        return True
    except (FileNotFoundError, NotADirectoryError):  # nothing there (its folder gone or a file)
        return True
    except IsADirectoryError:
        pass
    except PermissionError:  # unlink of a directory is EPERM on some systems
        if not path.is_dir():
            return False
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


def touch(path: Path) -> None:
    """Mark a block as just used (the sweep evicts the least recently used first), if it is still there."""
    try:
        os.utime(path, follow_symlinks=False)
    except OSError:
        pass
