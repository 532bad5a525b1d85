"""The storage interface: where and how checkpoint bytes become durable files, and are read back.

A backend is chosen by a path's URL scheme (plain paths are ``file``: protocol/storage/posix.py; ``s3://``:
protocol/storage/s3.py); the daemon's in-memory replicas have one of their own (daemon/replica/backend.py), which
adds taking over a spare's pages and handing them out to be filled directly. ``backend_for(path)`` is the shared
instance that reads, lists and answers what a path's storage can do; the daemon makes writing ones with its options
(``backend_class(path)(direct_io=..., owner=...)``). Nothing outside the backends asks which one a path has.

Writing, every call from a daemon's flush thread (or a trainer saving on its own):
1. ``create(path, token)`` opens a temporary file beside ``path`` (or starts an upload);
2. the pieces, any number, in any order: ``write(handle, offset, data)`` from memory where the medium takes bytes at
   any offset (``WritableStorage``: a file system), or ``upload(handle, fd, offset, length)`` of parts of a local
   file (``UploadedStorage``: an object store, whose parts the upload process reads from a committed file);
3. ``finalize(handle)`` makes the file durable and visible at ``path`` (fsync, rename, fsync of the folder; or the
   upload completed), or ``abort(handle)`` removes every trace of it (it never raises: what it cannot remove, the
   next daemon's recovery does: ``remove_leftovers``);
4. ``publish(path, data)`` writes a small file (a commit marker) with the same guarantees.

Reading, from either side: ``read(path)`` a small file whole, ``open(path)`` a file for positional reads (``pread``,
``preadv``, ``size``, ``close``), ``list(folder)``, ``exists(path)``, ``delete(path)``.

A backend raises StorageError, whose message names the path and the cause (disk full, read-only, I/O error).
"""

from __future__ import annotations

import errno
import importlib
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, Iterator, Protocol

from datastates.protocol.errors import InvalidRequestError, StorageError

Gone = Callable[[str, str | None], bool]
"""(owner tag, a path that writer left, or None) → whether that writer is dead: the daemon's ``Instance.gone``."""


class RangeReader(Protocol):
    """A file opened for positional reads (``Storage.open``)."""

    size: int

    def pread(self, length: int, at: int) -> bytes: ...

    def preadv(self, buffers: list[memoryview], at: int, until: int = 0) -> int: ...

    def close(self) -> None: ...



_LINK = ("a symbolic link, or a file, stands where a folder of its path was when it was admitted; datastates "
         "never follows one")
_CAUSES = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system", errno.EDQUOT: "quota exceeded"}


def storage_error(what: str, path: str, exc: OSError) -> StorageError:
    """The StorageError for ``exc`` met doing ``what`` to ``path``: the cause in words (disk full, a link)."""
    cause = _CAUSES.get(exc.errno or 0, exc.strerror or str(exc))
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        cause = f"{cause} ({_LINK})"
    return StorageError(f"{what} {path}: {cause}", path=path, errno=exc.errno or 0)


class Storage(ABC):
    """One kind of storage, reading and writing files through the sequence above."""

    scheme: ClassVar[str]
    mounted: ClassVar[bool]
    """A file system of this node: folders, renames, locks and links, usable as a daemon's root. False: a server
    every node reaches alike (an object store), read over the network, and written only from committed files."""

    def __init__(self, *, direct_io: bool = True, owner: str = "", **_options: Any) -> None:
        self.direct_io = direct_io
        self.owner = owner
        """Names this daemon in its temporary files (daemon/instances.py), so a later one knows whose they are."""
        self.kept: set[str] = set()
        """Dead writers' owner tags whose leftovers ``remove_leftovers`` could not all remove: their lock and journal
        stay for the next daemon (``Instance.forget_gone``), rather than be forgotten with work still to do."""

    @abstractmethod
    def create(self, path: str, token: str) -> Any: ...

    @abstractmethod
    def finalize(self, handle: Any) -> None: ...

    @abstractmethod
    def abort(self, handle: Any) -> None: ...

    @abstractmethod
    def publish(self, path: str, data: bytes, check: Callable[[int], None] | None = None) -> None:
        """Write a small file (a marker, a tracker) durably under ``path``. ``check``, if given, is called with the
        descriptor of the folder the file is renamed into, right before the rename; what it raises aborts it."""

    @abstractmethod
    def remove_leftovers(self, root: str, gone: Gone) -> list[str]:
        """Delete the temporary files under ``root`` whose owner is ``gone`` (a killed daemon of this node)."""

    @abstractmethod
    def read(self, path: str) -> bytes | None:
        """A small file whole (a marker, a tracker), or None if there is none."""

    @abstractmethod
    def open(self, path: str) -> RangeReader:
        """The file at ``path``, for positional reads."""

    @abstractmethod
    def list(self, folder: str) -> Iterator[tuple[str, int]]:
        """(path, size) of every file below ``folder``."""

    @abstractmethod
    def exists(self, path: str) -> bool: ...

    @abstractmethod
    def is_folder(self, path: str) -> bool:
        """Whether ``path`` can hold files now (an object store's prefix always can)."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Delete one file; one already gone is no error."""

    @abstractmethod
    def absolute(self, path: str, resolve: bool = False) -> str:
        """``path`` in the one form its storage names it by (``resolve``: with every link followed)."""

    @abstractmethod
    def join(self, folder: str, relative: str) -> str:
        """``relative`` (a normalized relative path, or ".") below ``folder``."""

    def connect(self, url: str, endpoint: str = "", region: str = "") -> None:
        """Reach the files below ``url`` (a tier's path) through its ``endpoint`` and ``region``: nothing for a
        storage that needs no server."""


class WritableStorage(Storage):
    """A storage whose files take bytes from memory, at any offset (step 2: ``write``)."""

    @abstractmethod
    def write(self, handle: Any, offset: int, data: memoryview) -> None: ...


class UploadedStorage(Storage):
    """A storage whose files are uploaded in parts from a local file (step 2: ``upload``)."""

    @abstractmethod
    def upload(self, handle: Any, fd: int, offset: int, length: int) -> Future:
        """Part ``length`` bytes of ``fd`` at ``offset`` into the file; a future done once it is stored."""


_BUILT_IN = {"file": "datastates.protocol.storage.posix", "s3": "datastates.protocol.storage.s3"}
"""Scheme → the module of its backend, imported on first use (a trainer that never reads ``s3://`` imports no S3)."""
_BACKENDS: dict[str, type[Storage]] = {}
_SHARED: dict[type[Storage], Storage] = {}


def register_backend(cls: type[Storage]) -> type[Storage]:
    _BACKENDS[cls.scheme] = cls
    return cls


def scheme_of(path: str | os.PathLike) -> str:
    """``path``'s URL scheme; ``file`` for a plain path (a ``Path`` is always one)."""
    return path.split("://", 1)[0] if isinstance(path, str) and "://" in path else "file"


def backend_class(path: str | os.PathLike) -> type[Storage]:
    scheme = scheme_of(path)
    if scheme not in _BACKENDS and scheme in _BUILT_IN:
        importlib.import_module(_BUILT_IN[scheme])
    cls = _BACKENDS.get(scheme)
    if cls is None:
        raise InvalidRequestError(f"no storage backend for scheme {scheme!r} (known: {sorted(_BUILT_IN)})")
    return cls


def backend_for(path: str | os.PathLike) -> Storage:
    """The shared instance of ``path``'s backend, with no options: for reading, and for what its storage can do."""
    cls = backend_class(path)
    if cls not in _SHARED:
        _SHARED[cls] = cls()
    return _SHARED[cls]
