"""The one write sequence of a checkpoint file: create → pieces → header → finalize, or abort.

The engine (a snapshot), the local fallback, and the tier transfers all write files
this way, through a WritableStorage backend, off the event loop (the pieces, head and finalize on a
flush thread, create and abort on a thread for small file work). A sink may also feed replicas:
secondary files written with the same bytes (the daemon's in-memory replica of a
snapshot). A replica's failure is contained: it drops that replica, logs why, and never
fails the primary file.

Call order (one call at a time, pieces in any order):
1. ``create()``, then ``replica_pages(size)`` at most once; 2. ``write(offset, data)`` any number of times
(``from_replica=True`` for data already in the pages ``replica_pages`` handed out; ``replicas=False`` for the file alone,
then ``write_replicas(offset, data)`` for the same bytes before step 3); 3. ``header(head,
size, tail_at, tail)`` once the checksums are known (a file without a separate header, a byte-for-byte
transfer, skips it); 4. ``finalize()`` makes the replicas then the primary durable, or
``abort()`` removes every trace of all of them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from datastates.protocol.errors import DatastatesError
from datastates.protocol.fileio import aligned_block
from datastates.protocol.storage import WritableStorage

from .replica.backend import MemoryStorage, ReplicaHandle

log = logging.getLogger(__name__)


class _Replica:
    def __init__(self, writer: MemoryStorage, path: str, reuse: str = "") -> None:
        self.writer = writer
        self.path = path
        self.reuse = reuse
        """A file beside it whose pages it may write over (the replica it replaces), or ""."""
        self.handle: ReplicaHandle | None = None
        self.failed = False
        self.pages: memoryview | None = None
        """Its own pages, filled directly by the copies (``FileSink.replica_pages``)."""


class FileSink:
    def __init__(self, writer: WritableStorage, path: str, token: str,
                 replicas: list[tuple[MemoryStorage, str, str]] | None = None) -> None:
        self._writer = writer
        self.path = path
        self._token = token
        self._handle: Any = None
        self._replicas = [_Replica(w, p, reuse) for w, p, reuse in replicas or []]

    @property
    def replicas_written(self) -> list[str]:
        """The replicas that have not failed (all of them made durable, once ``finalize`` returned)."""
        return [r.path for r in self._replicas if not r.failed]

    def create(self) -> None:
        self._handle = self._writer.create(self.path, self._token)
        for r in self._replicas:
            self._contain(r, lambda: setattr(r, "handle", r.writer.create(r.path, self._token, r.reuse)))

    def replica_pages(self, size: int) -> memoryview | None:
        """The first ``size`` bytes of a replica whose pages are memory, for copies to fill directly: the
        primary file is then written from them, and the replica costs no copy of its own. None if no replica
        can (none, or its writer's files are not memory, or they cannot be allocated: the replica is dropped)."""
        for r in self._replicas:
            self._contain(r, lambda: setattr(r, "pages", r.writer.pages(r.handle, size)))
            if r.pages is not None:
                return r.pages
        return None

    def write(self, offset: int, data: memoryview, from_replica: bool = False, replicas: bool = True) -> None:
        """``data`` at ``offset`` in the file, and in each replica (not with ``replicas=False``: the caller writes
        them later with ``write_replicas``)."""
        self._writer.write(self._handle, offset, data)
        if replicas:
            self.write_replicas(offset, data, from_replica)

    def write_replicas(self, offset: int, data: memoryview, from_replica: bool = False) -> None:
        for r in self._replicas:
            if not (from_replica and r.pages is not None):  # there already
                self._contain(r, lambda: r.writer.write(r.handle, offset, data))

    def _release_pages(self) -> None:
        """Let go of the pages ``replica_pages`` handed out, so the writer can unmap them; where the caller still
        holds a view of them (a failure cut its work short), they are unmapped with the last such view."""
        for r in self._replicas:
            if r.pages is not None:
                try:
                    r.pages.release()
                except BufferError:
                    pass
                r.pages = None

    def header(self, head: bytes, size: int, tail_at: int = 0, tail: bytes = b"") -> None:
        """The head (the index, now with every checksum, and what precedes the data), zero-padded to ``size``
        (the data region's start), at offset 0; and ``tail`` (a zip's central directory) at ``tail_at``."""
        self.write(0, aligned_block(head, size))
        if tail:
            self.write(tail_at, memoryview(tail))

    def finalize(self) -> None:
        self._release_pages()
        for r in self._replicas:
            self._contain(r, lambda: r.writer.finalize(r.handle))
        self._writer.finalize(self._handle)

    def abort(self) -> None:
        self._release_pages()
        for r in self._replicas:
            self._drop(r)
        if self._handle is not None:
            self._writer.abort(self._handle)
            self._handle = None

    def _contain(self, r: _Replica, step: Callable[[], None]) -> None:
        if r.failed:
            return
        try:
            step()
        except DatastatesError as exc:
            log.warning("replica %s of %s dropped: %s", r.path, self.path, exc)
            self._drop(r)

    @staticmethod
    def _drop(r: _Replica) -> None:
        if not r.failed and r.handle is not None:
            r.writer.abort(r.handle)
        r.failed = True
