"""The file primitives the daemon's writers and the trainer's reader share: one home each.

Durability is the same sequence everywhere (data, fsync, rename, fsync of the folder),
and large reads and writes go around the page cache where the file system allows it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import stat
import sys
import threading

from .errors import StorageError

PAGE = 4096
"""O_DIRECT's alignment of offsets, lengths and buffer addresses."""
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
"""renameat2(2) flags: refuse to replace an entry; swap two entries atomically."""
_libc = ctypes.CDLL(None, use_errno=True)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: map a whole range in one call instead of one fault per page (Python 3.12 names them)."""


def open_for_reading(path: str) -> int:
    """A descriptor for large reads of ``path``: O_DIRECT, but through the page cache on tmpfs (its pages are that
    memory: Linux 6.6 and later accept O_DIRECT there, and readers would then need aligned buffers for no gain) or
    where the file system refuses it."""
    if on_tmpfs(path):
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_range(fd: int, buf: mmap.mmap, offset: int, length: int) -> memoryview:
    """``length`` bytes of ``fd`` at ``offset`` (a multiple of PAGE), read into the start of ``buf`` (page-aligned,
    at least ``length`` rounded up to PAGE: O_DIRECT reads whole pages, and a file's tail reads short); StorageError
    (EIO) where the file ends first."""
    view = memoryview(buf)[:-(-length // PAGE) * PAGE]
    done = 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise StorageError(f"the source file ended at byte {offset + done}, before its committed size", errno=errno.EIO)
        done += n
    return view[:length]


def open_sequential(path: str) -> int:
    """A descriptor for one pass through ``path`` whose bytes are copied into memory the reader has already (an
    in-place load): through the page cache, so that the kernel reads ahead while the reader copies and hashes. The
    copy out of the page cache costs what one out of an O_DIRECT bounce buffer would, and the disk is never idle
    between a thread's reads (bench/restore.py, 1.54 GB in place: 0.870 s against 0.945 s for O_DIRECT on 8 threads,
    a raw O_DIRECT read into a reused buffer 0.826 s). ``forget_cached`` drops the pages it leaves."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except OSError:  # a hint a file system may refuse (ESPIPE on a pipe): the reads work without it
        pass
    return fd


def forget_cached(fd: int) -> None:
    """Drop the page cache's clean pages of ``fd``'s file on a thread of its own, then close ``fd`` (which this
    takes over): a restore leaves the node's memory as an O_DIRECT one would, and does not wait for the drop (0.06 s
    per 1.5 GB measured inline). Nothing on tmpfs, whose pages are the file."""

    def drop() -> None:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    threading.Thread(target=drop, name="ds-forget", daemon=True).start()


def on_tmpfs(path: str) -> bool:
    """Whether ``path`` lives on a tmpfs (/dev/shm, say), by the longest mount point above it (of mounts stacked on
    one point, the last listed: the one on top): its pages are memory."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                point = fields[1].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, fstype = point, fields[2]
    except OSError:
        return False
    return fstype == "tmpfs"


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder(path: str, create: bool = False, mode: int = 0o755, trusted: str = "/") -> int:
    """A descriptor of folder ``path``, reached from ``trusted`` one component at a time, never through a link.

    Every path the daemon writes was resolved when it was admitted, so a symbolic link met
    here appeared since: someone swapped a folder for a link, perhaps to one outside the
    roots. That raises OSError (ELOOP or ENOTDIR) instead of following it; every file
    operation then goes through the descriptor (``dir_fd``), so no later swap of a parent
    redirects it either. ``trusted`` (a root a user named, with links of its own) is opened
    as it is. With ``create``, missing folders are made, each new entry's parent fsynced.
    """
    rest = os.path.relpath(path, trusted)
    if rest == ".." or rest.startswith("../"):
        raise OSError(errno.EINVAL, f"{path} is not inside {trusted}", path)
    fd = os.open(trusted, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in rest.split("/"):
            if part in ("", "."):
                continue
            try:
                child = os.open(part, _FOLDER, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                    os.fsync(fd)
                except FileExistsError:
                    pass
                child = os.open(part, _FOLDER, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def rename_within(folder_fd: int, src: str, dst: str, flags: int) -> None:
    """renameat2(2) of entry ``src`` to ``dst`` of one folder (its descriptor), with ``flags`` (``RENAME_*``): what
    ``os.rename`` cannot do, swap two folders or refuse to replace one; OSError as the call fails."""
    sys.audit("datastates.rename", src, dst, folder_fd)  # counted as os.rename is (daemon/fsops.py)
    if _libc.renameat2(folder_fd, src.encode(), folder_fd, dst.encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), src)


def fsync_dir(path: str, trusted: str = "/") -> None:
    """Make the entries of folder ``path`` (a rename, a new file, an unlink) durable."""
    fd = open_folder(path, trusted=trusted)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str, trusted: str = "/", tree: bool = False) -> None:
    """Unlink file ``path`` (with ``tree``: delete folder ``path`` and all it holds) through its parent's
    descriptor, never through a link; FileNotFoundError if file ``path`` is gone.

    A tree emptied by another process at the same time (two finishers of one interrupted
    delete, protocol/retention.py) is no error: what it no longer finds is gone already.
    """
    parent = open_folder(os.path.dirname(path), trusted=trusted)
    try:
        if tree:
            shutil.rmtree(os.path.basename(path), dir_fd=parent, onerror=_gone_is_removed)
        else:
            os.unlink(os.path.basename(path), dir_fd=parent)
    finally:
        os.close(parent)


def remove_names(folder: str, names: list[str], trusted: str = "/") -> None:
    """Unlink the entries ``names`` of ``folder`` through one descriptor of it (``remove`` opens the folder anew for
    each); those already gone are no error."""
    fd = open_folder(folder, trusted=trusted)
    try:
        for name in names:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)


def _gone_is_removed(func: object, path: str, exc_info: tuple) -> None:
    """rmtree's error handler: re-raise anything but an entry already gone."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def read_regular(path: str) -> bytes:
    """The bytes of regular file ``path``; OSError for anything else (a FIFO, a device, a link), without blocking.

    Markers sit in folders other users may reach: opening a FIFO planted under a marker's
    name would block the reader (a trainer's load, the daemon's admission) until someone
    writes to it. ``O_NONBLOCK`` returns at once, and the type is checked on what was opened.
    """
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return f.read()


def aligned_block(data: bytes, size: int) -> memoryview:
    """``data`` zero-padded to ``size`` bytes in a page-aligned buffer: fit for an O_DIRECT write."""
    buf = mmap.mmap(-1, size)
    buf[: len(data)] = data
    return memoryview(buf)
