"""The in-memory replica backend: a snapshot's replica file in /dev/shm, its pages filled directly and reused.

A replica is a file system file (``PosixStorage``) on tmpfs, whose pages are memory. Two things set it apart:
``create(path, token, reuse)`` takes over a spare (the superseded replica of the same rank file, renamed to the
temporary name) so its pages are written over rather than allocated and zeroed again; and ``pages(handle, size)``
hands the file's own pages out, mapped shared, for the snapshot's copies to fill directly (``fills_directly``
says when), so the primary file is written from them and the replica costs no copy of its own. The mapping is
kept after ``finalize`` for the next replica that takes the file over; ``release_removed`` lets go of those whose
files were removed meanwhile (their pages are freed only then). The pages' mlock is locks.py's, the replica and spare
files' names and room folder.py's, the table of replicas and spares table.py's.

Call order: ``create`` (with ``reuse``), then ``pages`` at most once, then the posix sequence (``write`` any
number of times, ``finalize`` or ``abort``). ``ready_pages(path, size)``, between snapshots, maps a spare ahead.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from typing import Any

from datastates.protocol.fileio import MADV_POPULATE_WRITE, on_tmpfs
from datastates.protocol.storage import storage_error
from datastates.protocol.storage.posix import FileHandle, PosixStorage


class _Mapped:
    """A tmpfs file's pages, mapped shared, every page mapped now. Kept by the backend after the file is
    finalized: the daemon's next replica of the same rank file takes this file over (a spare, renamed,
    the same inode) and finds its pages mapped already, instead of mapping 4 KiB pages one by one again."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        """Kept open: its link count says when the file was removed, and the mapping must go."""
        st = os.fstat(fd)
        self.key = (st.st_dev, st.st_ino)
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self.map.madvise(MADV_POPULATE_WRITE)
        except OSError:  # before Linux 5.14: the copies fault the (allocated) pages in
            pass

    def removed(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view of it lives on: the pages go unmapped with the last of them
            pass
        os.close(self.fd)


@dataclass
class ReplicaHandle(FileHandle):
    mapped: _Mapped | None = None
    """The file's pages (``MemoryStorage.pages``)."""
    kept: _Mapped | None = None
    """The backend's kept mapping of the file this one took over (``reuse``), for ``pages`` to use; closed
    at finalize if it did not: a file rewritten through ``write`` may be cut shorter than it maps."""

    def close(self) -> None:
        for mapped in (self.mapped, self.kept):
            if mapped is not None:
                mapped.close()
        self.mapped = self.kept = None
        super().close()


class MemoryStorage(PosixStorage):
    handle_type = ReplicaHandle

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._kept: dict[tuple[int, int], _Mapped] = {}
        """The mappings of finalized tmpfs files, by inode, for the next ``create`` that takes one over."""
        self._kept_lock = threading.Lock()

    @staticmethod
    def fills_directly(spare: str, fenced: bool) -> bool:
        """Whether a snapshot's copies fill its replica's pages (``pages``) rather than pool chunks: only over a
        ``spare``'s pages (fresh ones would be allocated before the copy, where the trainer may wait on them, not on
        a flush thread after it), and not for GPU copies (``fenced``), which want pinned chunks."""
        return bool(spare) and not fenced

    def create(self, path: str, token: str, reuse: str = "") -> ReplicaHandle:  # type: ignore[override]
        """The file ``path`` under its temporary name; ``reuse``: a spare of the same folder to take over."""
        handle = self._create(path, token, reuse, None)
        assert isinstance(handle, ReplicaHandle)
        if reuse:
            st = os.fstat(handle.fd)
            with self._kept_lock:
                handle.kept = self._kept.pop((st.st_dev, st.st_ino), None)
        return handle

    def pages(self, handle: ReplicaHandle, size: int) -> memoryview | None:
        """The file's first ``size`` bytes as writable memory, every page allocated, for the caller to fill
        rather than ``write`` from a buffer of its own; None where the file is not on tmpfs. A file taken over
        (``reuse``) whose pages this backend mapped before, at this size, gets that mapping back; any other is
        allocated first with ``fallocate``, so a full /dev/shm is a StorageError here, not a SIGBUS at a store
        into a page it cannot back. ``finalize`` or ``abort`` unmaps them once the caller's views are gone."""
        if not on_tmpfs(handle.temp):
            return None
        kept, handle.kept = handle.kept, None
        try:
            fd = os.open(os.path.basename(handle.temp), os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=handle.folder)
            if kept is not None and len(kept.map) == size and os.fstat(fd).st_size >= size:
                os.close(fd)
                handle.mapped, kept = kept, None
            else:
                try:
                    os.posix_fallocate(fd, 0, size)
                    handle.mapped = _Mapped(fd, size)
                except BaseException:
                    os.close(fd)
                    raise
        except OSError as exc:
            raise storage_error("cannot allocate", handle.path, exc) from None
        finally:
            if kept is not None:
                kept.close()
        with handle.lock:
            handle.end = max(handle.end, size)
        return memoryview(handle.mapped.map)

    def ready_pages(self, path: str, size: int) -> None:
        """Allocate the first ``size`` bytes of the spare ``path`` and map them now, so that a later ``create``
        taking it over gets ``pages`` of that size with no allocation or mapping on its own path; OSError where
        they cannot be."""
        if not on_tmpfs(os.path.dirname(path)):
            return
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)  # never made here: taken over meanwhile, it is gone
        try:
            st = os.fstat(fd)
            with self._kept_lock:
                kept = self._kept.get((st.st_dev, st.st_ino))
            if kept is not None and len(kept.map) == size:  # filled directly last time: mapped already
                os.close(fd)
                return
            os.posix_fallocate(fd, 0, size)
            mapped = _Mapped(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._keep(mapped)
        self.release_removed()  # the file removed meanwhile (a spare dropped): its pages go now, not at the next removal

    def _keep(self, mapped: _Mapped) -> None:
        """``mapped`` kept for the next ``create`` that takes its file over; an older mapping of the file goes."""
        with self._kept_lock:
            old = self._kept.pop(mapped.key, None)
            self._kept[mapped.key] = mapped
        if old is not None:
            old.close()

    def release_removed(self) -> None:
        """Unmap the kept files removed since: their pages are freed only then."""
        with self._kept_lock:
            for key in [k for k, m in self._kept.items() if m.removed()]:
                self._kept.pop(key).close()

    def finalize(self, handle: ReplicaHandle) -> None:  # type: ignore[override]
        """The posix finalize; the file's pages stay mapped for the next replica that takes it over."""
        mapped, handle.mapped = handle.mapped, None
        try:
            super().finalize(handle)
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        if mapped is not None:
            self._keep(mapped)
