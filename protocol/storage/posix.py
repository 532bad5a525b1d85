"""The local / parallel file-system backend: temporary name, pwrite, fsync, rename; pread to read.

Data goes through O_DIRECT where the file system allows it: the pool's chunks are page
aligned and pieces are multiples of 4 KiB, so large writes skip the page cache, cost
little CPU, and leave the cache to the trainer. A file system that refuses O_DIRECT
(tmpfs), or a write that is not aligned, falls back to a buffered descriptor of the same file.

Every name is opened, renamed and removed through its folder's descriptor, reached
without following any symbolic link (``open_folder``): a folder swapped for a link after
admission fails that file instead of redirecting it outside the roots.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import PathNotAllowedError
from ..fileio import PAGE, RENAME_EXCHANGE, RENAME_NOREPLACE, open_folder, remove, rename_within
from ..format import DONE_PREFIX, TEMP_SUFFIX, TEMP_TOKEN_MAX, CommitMarker
from ..paths import shallow_walk
from ..tags import file_commits, file_snapshot
from .base import Gone, WritableStorage, register_backend, storage_error

log = logging.getLogger(__name__)


_TEMP_RE = re.compile(r"\..+\.([0-9a-f]{16})-[^./]+" + re.escape(TEMP_SUFFIX))
"""A temporary name ``temp_path`` made, with a daemon's owner tag: the owner."""


def temp_path(path: str, token: str) -> str:
    """The hidden temporary name a file is written under until it is durable."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{token}{TEMP_SUFFIX}")


LEFTOVER_DEPTH = 3


@contextlib.contextmanager
def folder_locked(folder: int) -> Iterator[None]:
    """An exclusive flock on a folder (its descriptor) for a check and the rename it guards: a commit's check of its
    listed files and its marker's rename, or a writer's look at what is at its path and its exchange. Two writers of
    one node (the daemon, a trainer saving on its own) then never interleave the two (the fault schedules, seed
    220373: a trainer's exchange between a commit's check and its marker's rename replaced a committed file)."""
    # One open file description with ``folder``: its own flock below is no second lock, and the lock outlives
    # ``folder`` being closed inside (a publish's finalize releases it).
    held = os.dup(folder)
    locked = False
    try:
        try:
            fcntl.flock(held, fcntl.LOCK_EX)
            locked = True
        except OSError as exc:  # a file system without flock (Lustre mounted noflock): the checks alone, as before
            if exc.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL):
                raise
        yield
    finally:
        # Unlocked, not only closed: another descriptor of the description (in a child a trainer saving on its own
        # forked meanwhile) would hold the lock for as long as it lives. Nested on one description (a publish, then
        # its finalize), the inner exit unlocks: the finalize is the publish's last step under the lock.
        if locked:
            fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)


def _place(folder: int, temp: str, path: str) -> None:
    """Rename the finished ``temp`` to ``path``'s name in ``folder`` (a descriptor), never over a committed file.

    A file there already that a marker lists as the snapshot it holds is another writer's
    committed file (a trainer that saved the same path on its own, twin ranks of one path):
    this save is refused, rather than changing a committed file's bytes. It is looked at in
    place first, so a committed file is never moved off its name (a kill in between would leave
    it under the temporary name, which the next daemon removes); any other regular file is
    exchanged with ``temp`` in one step (RENAME_EXCHANGE) and looked at again under the temporary
    name, in case one was committed meanwhile: then it is exchanged back. Anything but a regular
    file there (a directory, a link) meets ``os.replace`` as before: a directory is never moved.
    """
    name = os.path.basename(path)
    try:
        rename_within(folder, temp, name, RENAME_NOREPLACE)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):  # a file system without renameat2's flags: as before
            raise
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
        return
    if not stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
        return
    refused = PathNotAllowedError(f"path {path!r} refused: another writer committed it while this snapshot was "
                                  "being written (a trainer saving the same path on its own?), and a committed "
                                  "file's bytes never change", path=path)
    if _committed(folder, name, path):
        raise refused
    try:
        rename_within(folder, temp, name, RENAME_EXCHANGE)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):  # no RENAME_EXCHANGE here: it was looked at in place
            raise
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
        return
    try:
        committed = _committed(folder, temp, path)
    except BaseException:  # not a file it can read (a directory made there meanwhile): put back where it was
        rename_within(folder, temp, name, RENAME_EXCHANGE)
        raise
    if committed:
        rename_within(folder, temp, name, RENAME_EXCHANGE)
        raise refused
    os.unlink(temp, dir_fd=folder)


def _committed(folder: int, name: str, path: str) -> bool:
    """Whether the file ``name`` in ``folder`` is what a marker lists for ``path``: its snapshot, or (a marker
    listing none) its size."""
    held, size = file_snapshot(name, folder), os.stat(name, dir_fd=folder, follow_symlinks=False).st_size
    return any(entry.holds(held, size) for _, _, entry in file_commits(path, roots=("/",)))


@dataclass
class FileHandle:
    """A file being written under its temporary name (``PosixStorage.create``)."""

    path: str
    temp: str
    folder: int
    """The descriptor of the file's folder: every name below is opened, renamed and removed through it."""
    fd: int
    direct: bool
    reused: bool = False
    """It took over an older file, which may be longer: cut to where the writes end when finalized."""
    end: int = 0
    """Where the furthest write ended (flush threads write pieces in parallel: under ``lock``)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    buffered_fd: int = -1

    def fd_for(self, offset: int, length: int) -> int:
        if not self.direct or (offset % PAGE == 0 and length % PAGE == 0):
            return self.fd
        return self.buffered()

    def buffered(self) -> int:
        if self.buffered_fd < 0:
            self.buffered_fd = os.open(os.path.basename(self.temp), os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW,
                                       dir_fd=self.folder)
        return self.buffered_fd

    def close(self) -> None:
        for fd in (self.fd, self.buffered_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.buffered_fd = -1

    def release(self) -> None:
        self.close()
        if self.folder >= 0:
            os.close(self.folder)
            self.folder = -1


class PosixStorage(WritableStorage):
    scheme = "file"
    mounted = True
    handle_type: type[FileHandle] = FileHandle

    def create(self, path: str, token: str, direct: bool | None = None) -> FileHandle:
        return self._create(path, token, "", direct)

    def _create(self, path: str, token: str, reuse: str, direct: bool | None) -> FileHandle:
        """``create``, taking over the file ``reuse`` of the same folder where one is named: its pages are
        written over, not allocated and zeroed again (the daemon's in-memory replicas)."""
        if len(token) > TEMP_TOKEN_MAX:  # the name's limit counts on it (protocol/format.py TEMP_RESERVE)
            token = hashlib.blake2b(token.encode(), digest_size=TEMP_TOKEN_MAX // 2).hexdigest()
        temp = temp_path(path, f"{self.owner}-{token}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        want_direct = self.direct_io if direct is None else direct
        try:
            folder = open_folder(os.path.dirname(path), create=True)
        except OSError as exc:
            raise storage_error("cannot create", path, exc) from None
        try:
            if reuse:  # its pages are written over, not allocated and zeroed again; cut to size at finalize
                os.rename(os.path.basename(reuse), os.path.basename(temp), src_dir_fd=folder, dst_dir_fd=folder)
                flags &= ~(os.O_CREAT | os.O_EXCL)
            try:
                fd = os.open(os.path.basename(temp), flags | (os.O_DIRECT if want_direct else 0), 0o644, dir_fd=folder)
            except OSError as exc:
                if not (want_direct and exc.errno == errno.EINVAL):
                    raise
                want_direct = False  # no O_DIRECT here (the file was not opened, nor created)
                fd = os.open(os.path.basename(temp), flags, 0o644, dir_fd=folder)
        except OSError as exc:
            os.close(folder)
            raise storage_error("cannot create", path, exc) from None
        return self.handle_type(path=path, temp=temp, folder=folder, fd=fd, direct=want_direct, reused=bool(reuse))

    def write(self, handle: FileHandle, offset: int, data: memoryview) -> None:
        with handle.lock:
            handle.end = max(handle.end, offset + len(data))
        try:
            fd = handle.fd_for(offset, len(data))
            done = 0
            while done < len(data):
                try:
                    done += os.pwrite(fd, data[done:], offset + done)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or fd != handle.fd or not handle.direct:
                        raise
                    fd = handle.buffered()  # an unaligned buffer address: write it through the cache
        except OSError as exc:
            raise storage_error("cannot write", handle.path, exc) from None

    def finalize(self, handle: FileHandle) -> None:
        try:
            if handle.reused:
                os.ftruncate(handle.fd, handle.end)
            os.fsync(handle.fd)
            handle.close()
            with folder_locked(handle.folder):
                _place(handle.folder, os.path.basename(handle.temp), handle.path)
            os.fsync(handle.folder)
        except PathNotAllowedError:
            self.abort(handle)
            raise
        except OSError as exc:
            self.abort(handle)
            raise storage_error("cannot make durable", handle.path, exc) from None
        handle.release()

    def abort(self, handle: FileHandle) -> None:
        if handle.folder < 0:
            return  # finalized, or aborted already: its temporary name is gone
        handle.close()
        try:
            os.unlink(os.path.basename(handle.temp), dir_fd=handle.folder)
        except FileNotFoundError:
            pass
        except OSError as exc:  # the folder turned read-only, or is gone: the next daemon's recovery removes it
            log.warning("cannot remove temporary file %s (%s); it is left for the next daemon to remove",
                        handle.temp, exc.strerror)
        finally:
            handle.release()

    def publish(self, path: str, data: bytes, check: Callable[[int], None] | None = None) -> None:
        handle = self.create(path, f"{os.getpid()}-{id(data):x}", direct=False)
        try:
            self.write(handle, 0, memoryview(data))
            with folder_locked(handle.folder):  # no writer's rename (this process's or a trainer's) between the two
                if check is not None:
                    check(handle.folder)
                self.finalize(handle)
        except BaseException:
            self.abort(handle)
            raise

    def remove_leftovers(self, root: str, gone: Gone) -> list[str]:
        removed = []
        for folder, _, files in shallow_walk(root, LEFTOVER_DEPTH):  # checkpoints live at <root>/<tag>/<file>
            for name in files:
                path = os.path.join(folder, name)
                if _left_by(name, path, gone):
                    try:
                        remove(path, trusted=root)
                        removed.append(path)
                    except OSError:
                        continue
        return removed

    def read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def open(self, path: str) -> _File:
        return _File(path)

    def list(self, folder: str) -> Iterator[tuple[str, int]]:
        for below, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(below, name)
                with contextlib.suppress(FileNotFoundError):
                    yield path, os.stat(path, follow_symlinks=False).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def is_folder(self, path: str) -> bool:
        return os.path.isdir(path)

    def delete(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def absolute(self, path: str, resolve: bool = False) -> str:
        return os.path.realpath(path) if resolve else os.path.abspath(path)

    def join(self, folder: str, relative: str) -> str:
        return os.path.normpath(os.path.join(folder, relative))


def _left_by(name: str, path: str, gone: Gone) -> bool:
    """Whether ``path`` is a temporary file or a done marker (daemon/gather.py) of a dead writer (``gone``)."""
    temp = _TEMP_RE.fullmatch(name)
    if temp:
        return gone(temp.group(1), path)
    if name.startswith(DONE_PREFIX):
        done = CommitMarker.read(path)
        return done is not None and gone(done.owner, path)
    return False


class _File:
    """A file opened for positional reads (``PosixStorage.open``), through the page cache."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size

    def pread(self, length: int, at: int) -> bytes:
        return os.pread(self.fd, length, at)

    def preadv(self, buffers: list[memoryview], at: int, until: int = 0) -> int:
        return os.preadv(self.fd, buffers, at)

    def close(self) -> None:
        os.close(self.fd)


register_backend(PosixStorage)
