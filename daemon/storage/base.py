"""Storage writers: where and how checkpoint bytes become durable files.

Call order, every call from a flush thread:
1. ``create(path, token, reuse="")`` opens a temporary file beside ``path``; ``reuse`` names a file of the
   same folder to take over instead (its pages are reused: the daemon's in-memory replicas); a writer
   that cannot ignores it, and the caller removes it;
2. ``write(handle, offset, data)`` any number of times, in any order; before them, ``pages(handle, size)``
   may hand out the file's own pages (a file that is memory) for the caller to fill in place instead;
3. ``finalize(handle)`` makes the file durable and visible at ``path`` (fsync, rename,
   fsync of the folder), or ``abort(handle)`` removes every trace of it (it never raises: what it cannot
   remove, the next daemon's recovery does);
4. ``publish(path, data)`` writes a small file (a commit marker) with the same guarantees.

A writer raises StorageError, whose message names the path and the cause (disk full,
read-only, I/O error). Writers are registered by URL scheme (plain paths are ``file``);
the engine makes one instance of each, with the node config's options.
"""

from __future__ import annotations

import errno
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar

from datastates.protocol.errors import InvalidRequestError, StorageError

from ..instances import Gone


_LINK = ("a symbolic link, or a file, stands where a folder of its path was when it was admitted; datastates "
         "never follows one")
_CAUSES = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system", errno.EDQUOT: "quota exceeded"}


def storage_error(what: str, path: str, exc: OSError) -> StorageError:
    """The StorageError for ``exc`` met doing ``what`` to ``path``: the cause in words (disk full, a link)."""
    cause = _CAUSES.get(exc.errno or 0, exc.strerror or str(exc))
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        cause = f"{cause} ({_LINK})"
    return StorageError(f"{what} {path}: {cause}", path=path, errno=exc.errno or 0)


class StorageWriter(ABC):
    scheme: ClassVar[str]

    def __init__(self, *, direct_io: bool = True, owner: str = "") -> None:
        self.direct_io = direct_io
        self.owner = owner
        """Names this daemon in its temporary files (daemon/instances.py), so a later one knows whose they are."""
        self.kept: set[str] = set()
        """Dead writers' owner tags whose leftovers ``remove_leftovers`` could not all remove: their lock and journal
        stay for the next daemon (``Instance.forget_gone``), rather than be forgotten with work still to do."""

    @abstractmethod
    def create(self, path: str, token: str, reuse: str = "") -> Any: ...

    @abstractmethod
    def write(self, handle: Any, offset: int, data: memoryview) -> None: ...

    def pages(self, handle: Any, size: int) -> memoryview | None:
        """The file's first ``size`` bytes as writable memory, every page allocated, for the caller to fill
        in place rather than ``write`` from a buffer of its own: one memcpy less. None where the file's pages
        are not memory (a disk), as here; StorageError where they cannot be allocated (the file system is full).
        ``finalize`` or ``abort`` unmaps them once the caller's views of them are gone."""
        return None

    def ready_pages(self, path: str, size: int) -> None:
        """Allocate the first ``size`` bytes of the file ``path`` and map them now, so that a later
        ``create`` taking the file over (``reuse``) gets ``pages`` of that size with no allocation or mapping on its
        own path; OSError where they cannot be. Nothing where a file's pages are not memory, as here."""

    def release_removed(self) -> None:
        """Let go of what the writer still holds of files removed since (``pages``' mappings); nothing here."""

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


_WRITERS: dict[str, type[StorageWriter]] = {}


def register_writer(cls: type[StorageWriter]) -> type[StorageWriter]:
    _WRITERS[cls.scheme] = cls
    return cls


def writer_class(path: str) -> type[StorageWriter]:
    scheme = path.split("://", 1)[0] if "://" in path else "file"
    cls = _WRITERS.get(scheme)
    if cls is None:
        raise InvalidRequestError(f"no storage writer for scheme {scheme!r} (known: {sorted(_WRITERS)})")
    return cls
