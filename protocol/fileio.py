"""The file primitives the daemon's writers and the trainer's reader share: one home each.

Durability is the same sequence everywhere (data, fsync, rename, fsync of the folder),
and large reads and writes go around the page cache where the file system allows it.
"""

from __future__ import annotations

import mmap
import os

PAGE = 4096
"""O_DIRECT's alignment of offsets, lengths and buffer addresses."""


def open_for_reading(path: str) -> int:
    """A descriptor for large reads of ``path``: O_DIRECT, or through the page cache where the file system refuses it (tmpfs)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def fsync_dir(path: str) -> None:
    """Make the entries of folder ``path`` (a rename, a new file, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(folder: str, mode: int = 0o755) -> None:
    """Create ``folder`` and its missing parents, fsyncing each new entry's parent."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for new in reversed(missing):
        try:
            os.mkdir(new, mode)
        except FileExistsError:
            continue
        fsync_dir(os.path.dirname(new))


def aligned_block(data: bytes, size: int) -> memoryview:
    """``data`` zero-padded to ``size`` bytes in a page-aligned buffer: fit for an O_DIRECT write."""
    buf = mmap.mmap(-1, size)
    buf[: len(data)] = data
    return memoryview(buf)
