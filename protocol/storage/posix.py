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
from typing import Callable, Iterator, Sequence

from .. import retention
from ..errors import ConfigError, CorruptCheckpointError, DatastatesError, PathNotAllowedError
from ..fileio import (PAGE, RENAME_EXCHANGE, RENAME_NOREPLACE, forget_cached, on_tmpfs, open_folder, open_for_reading,
                      open_sequential, read_regular, remove, rename_within)
from ..format import DONE_PREFIX, TEMP_SUFFIX, TEMP_TOKEN_MAX, CommitMarker, MarkerFile, marker_name
from ..paths import shallow_walk, within
from ..tags import (CommittedTag, distrust, file_snapshot, marker_names, marker_paths, tag_files, trusted_marker,
                    unlisted, untrusted_folder)
from .base import Gone, Reads, WritableStorage, register_backend, storage_error

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
    return any(entry.holds(held, size) for _, _, entry in PosixStorage.commits_of(path, roots=("/",)))


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

    def open(self, path: str, reads: Reads = "small") -> _File:
        return _File(path, reads)

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

    def tier_path(self, path: str, first: bool) -> str:
        if not os.path.isabs(path):
            raise ConfigError(f"{path!r} must be an absolute path or s3://bucket/prefix")
        return os.path.realpath(path)

    def read_marker(self, path: str) -> CommitMarker | None:
        return CommitMarker.read(path)

    def whole(self, folder: str, marker: CommitMarker) -> bool:
        return not unlisted(folder, marker)

    def trusts(self, path: str) -> bool:
        if not os.path.lexists(path):  # no tag committed here (a new node's fast tier, an interrupted save): no warning
            return False
        why = distrust(path)
        if why:
            log.warning("skipping the commit marker %s: %s", path, why)
        return not why

    def markers(self, root: str, depth: int, strict: bool) -> list[tuple[str, CommitMarker | None]]:
        return [(path, trusted_marker(path)) for path in marker_paths(root, depth)]

    @staticmethod
    def commits_of(path: str, depth: int = 3, roots: Sequence[str] | None = None) -> list[tuple[str, CommitMarker,
                                                                                                MarkerFile]]:
        """``file_commits``: the markers in the ``depth`` folders above ``path``, climbing no further than this user
        may trust (or, with ``roots``, than a root)."""
        out = []
        folder = os.path.dirname(os.path.abspath(path))
        for _ in range(depth):
            beyond = not any(within(folder, r) for r in roots) if roots is not None else untrusted_folder(folder)
            if beyond:
                break
            rel = os.path.relpath(path, folder)
            for marker_path in marker_names(folder):
                marker = trusted_marker(marker_path, whole=False) if roots is None else CommitMarker.read(marker_path)
                entry = next((f for f in marker.files if f.path == rel), None) if marker is not None else None
                if entry is not None:
                    out.append((marker_path, marker, entry))
            if os.path.dirname(folder) == folder:
                break
            folder = os.path.dirname(folder)
        return out

    def folders(self, root: str) -> list[tuple[str, str, int, int, int, bool]]:
        out = []
        for name in sorted(os.listdir(root)):
            folder = os.path.join(root, name)
            if not os.path.isdir(folder) or name.startswith("."):
                continue
            on_disk = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
            size = sum(os.path.getsize(f) for f in on_disk if os.path.isfile(f))
            marked = CommitMarker.read(os.path.join(folder, marker_name(name))) is not None
            out.append((name, folder, len(on_disk), size, int(os.path.getmtime(folder) * 1e9), marked))
        return out

    def files_at(self, target: str, skipped: Callable[[str, str], None]) -> list[str]:
        if os.path.isfile(target):
            return [target]
        found = [p for p in marker_paths(target) if os.path.dirname(p) == os.path.abspath(target).rstrip("/")]
        return _listed(target, target, found, skipped)

    def tag_files_named(self, root: str, tag: str, skipped: Callable[[str, str], None]) -> list[str]:
        return _listed(tag, root, [p for p in marker_paths(root) if os.path.basename(p) == marker_name(tag)], skipped)

    def why_kept(self, tag: CommittedTag) -> str:
        return retention.kept(tag, tag.folder)

    def delete_tag(self, tag: CommittedTag, root: str) -> bool:
        return retention.delete_tag(tag, root)

    def finish_deletes(self, root: str) -> None:
        retention.finish_deletes(root)


def _left_by(name: str, path: str, gone: Gone) -> bool:
    """Whether ``path`` is a temporary file or a done marker (daemon/gather.py) of a dead writer (``gone``)."""
    temp = _TEMP_RE.fullmatch(name)
    if temp:
        return gone(temp.group(1), path)
    if name.startswith(DONE_PREFIX):
        done = CommitMarker.read(path)
        return done is not None and gone(done.owner, path)
    return False


def _listed(target: str, where: str, found: list[str], skipped: Callable[[str, str], None]) -> list[str]:
    """The files the markers ``found`` (those this user may trust) list."""
    untrusted = {path: why for path in found if (why := distrust(path))}
    for path, why in untrusted.items():
        skipped(path, why)
    found = [path for path in found if path not in untrusted]
    if not found:
        raise CorruptCheckpointError(f"no commit marker for {target!r} (looked in {where})")
    files = []
    for path in found:
        try:
            marker = CommitMarker.decode(read_regular(path))
        except (OSError, ValueError, DatastatesError) as exc:
            raise CorruptCheckpointError(f"{path}: unreadable commit marker: {exc}") from None
        files += tag_files(os.path.dirname(path), marker)
    return files


IOV_MAX = 1024


class _File:
    """A file opened for positional reads (``PosixStorage.open``): through the page cache, or past it (``direct``)."""

    streams = None

    def __init__(self, path: str, reads: Reads = "small") -> None:
        self.path = path
        self._reads = reads
        self.mapped = on_tmpfs(path)
        self.fd = open_for_reading(path) if reads == "direct" else open_sequential(path) if reads == "sequential" \
            else os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.size = os.fstat(self.fd).st_size
        self.direct = bool(fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT)

    def pread(self, length: int, at: int) -> bytes:
        """Up to ``length`` bytes at ``at`` (fewer only at the end)."""
        return os.pread(self.fd, length, at)

    def preadv(self, buffers: list[memoryview], at: int, until: int = 0) -> int:
        """Fill ``buffers`` (IOV_MAX of them at most) in order from byte ``at``; the bytes read."""
        return os.preadv(self.fd, buffers[:IOV_MAX], at)

    def close(self) -> None:
        """Let go of the descriptor (a sequential pass's pages dropped from the cache on a thread of their own)."""
        if self.fd < 0:
            return
        if self._reads == "sequential" and not self.mapped:
            forget_cached(self.fd)
        else:
            os.close(self.fd)
        self.fd = -1


register_backend(PosixStorage)
