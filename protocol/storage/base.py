"""The storage interface: where and how checkpoint bytes become durable files, and are read back.

A backend is chosen by a path's URL scheme (plain paths are ``file``: protocol/storage/posix.py; ``s3://``:
protocol/storage/s3/); the daemon's in-memory replicas have one of their own (daemon/replica/backend.py), which
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

Reading, from either side: ``read(path)`` a small file whole, ``open(path, reads)`` a file for positional reads
(``pread``, ``preadv``, ``size``, ``close``), ``list(folder)``, ``exists(path)``, ``delete(path)``.

Commit markers (protocol/tags.py's one scanner asks these, never which backend a path has): ``read_marker``,
``whole``, ``trusts``, ``markers`` (a root's scan), ``commits_of`` (the markers listing a file); retention's
``why_kept`` and ``delete_tag``; ``unchanged`` (a file read is still the one its marker lists).

A backend raises StorageError, whose message names the path and the cause (disk full, read-only, I/O error).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Callable, ClassVar, ContextManager, Iterable, Iterator, Literal, Protocol, Sequence, TypeVar

from datastates.protocol.errors import DatastatesError, InvalidRequestError, StorageError

# CommitMarker and MarkerFile (protocol/format.py), Tier (protocol/descriptors.py) and CommittedTag (protocol/tags.py)
# are named in the hints below, not imported: those modules read through this one.

T = TypeVar("T")
Gone = Callable[[str, str | None], bool]
"""(owner tag, a path that writer left, or None) → whether that writer is dead: the daemon's ``Instance.gone``."""


Reads = Literal["small", "direct", "sequential"]
"""How a file is read (``Storage.open``): a few small reads (a header, a tail); large reads that bypass the page cache
where the file system allows (O_DIRECT); one pass through the page cache, its pages dropped on close."""


class RangeReader(Protocol):
    """A file opened for positional reads (``Storage.open``).

    ``direct``: reads bypass the page cache (buffers and offsets on whole blocks); ``mapped``: its bytes are memory
    already (tmpfs), to be mapped rather than read; ``streams``: reads in flight that serve it best (None: the
    reader picks its threads)."""

    path: str
    size: int
    direct: bool
    mapped: bool
    streams: int | None

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
    def open(self, path: str, reads: Reads = "small") -> RangeReader:
        """The file at ``path``, for positional reads of the kind ``reads``."""

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

    @abstractmethod
    def read_marker(self, path: str) -> CommitMarker | None:
        """The commit marker (or done marker) at ``path`` as it reads, whole or not; None: absent, or not one."""

    @abstractmethod
    def whole(self, folder: str, marker: CommitMarker) -> bool:
        """Whether every file ``marker`` (in ``folder``) lists is there at the size it lists."""

    @abstractmethod
    def trusts(self, path: str) -> bool:
        """Whether the marker at ``path`` may speak for this user (one that may not is logged); False if absent."""

    @abstractmethod
    def markers(self, root: str, depth: int, strict: bool) -> list[tuple[str, CommitMarker | None]]:
        """(path, ``trusted_marker(path)``) of every file named like a commit marker in ``root`` and ``depth``
        folders down. ``strict``: one that cannot be read raises, rather than being skipped."""

    @abstractmethod
    def commits_of(self, path: str, depth: int, roots: Sequence[str] | None) -> list[tuple[str, CommitMarker,
                                                                                          MarkerFile]]:
        """(marker path, marker, its entry) of every commit marker that lists the file ``path`` (``file_commits``)."""

    @abstractmethod
    def why_kept(self, tag: CommittedTag) -> str:
        """Why the committed ``tag`` must not be deleted now ("" if it may): retention's guards."""

    @abstractmethod
    def delete_tag(self, tag: CommittedTag, root: str) -> bool:
        """Delete ``tag`` of ``root``, its marker withdrawn first; whether it went (one kept is logged)."""

    @abstractmethod
    def folders(self, root: str) -> list[tuple[str, str, int, int, int, bool]]:
        """(name, path, files, bytes, last change in ns or 0, whether a marker of its name is there) of each tag
        folder directly under ``root`` (not hidden): what ``datastatesctl ls`` shows."""

    @abstractmethod
    def files_at(self, target: str, skipped: Callable[[str, str], None]) -> list[str]:
        """What ``datastatesctl verify target`` checks: ``target`` itself, or the files the commit markers of the
        folder ``target`` list (a listed file that is missing too, so it is reported); ``skipped(marker, why)`` is
        told of a marker this user may not trust. CorruptCheckpointError if a folder holds no marker."""

    @abstractmethod
    def tag_files_named(self, root: str, tag: str, skipped: Callable[[str, str], None]) -> list[str]:
        """``files_at`` of the tag named ``tag`` under ``root``."""

    def finish_deletes(self, root: str) -> None:
        """Finish the deletes of ``root`` a killed prune left: nothing where a delete leaves nothing to finish."""

    def one_read(self, whole: bool = False) -> ContextManager[None]:
        """A context within which the reads of one load (``open`` of the same path, again and again) see one version
        of each file; ``whole``: the load reads the data region too. Nothing to do where a committed file never
        changes."""
        return contextlib.nullcontext()

    def unchanged(self, folder: str, name: str, marker: CommitMarker) -> bool:
        """Whether the file ``name`` of ``folder``, just read, is still what ``marker`` (its tag's) lists: always, where
        a committed file's bytes never change (a tag saved again is renamed into place whole)."""
        return True

    def unreachable(self, exc: DatastatesError) -> bool:
        """Whether ``exc``, met reading here, says this storage could not be reached (a server down, refusing), so
        another tier's copy may serve instead; a file system's errors say something of its files: never."""
        return False

    def probe(self, fn: Callable[[str], T], place: str) -> Future:
        """``fn(place)``, a read of this storage: here and now, its error raised, where an answer always comes."""
        done: Future = Future()
        done.set_result(fn(place))
        return done

    def root_folders(self, path: str) -> list[str]:
        """The folders of this node a tier at ``path`` adds to a daemon's roots: the tier's own."""
        return [path]

    @abstractmethod
    def tier_path(self, path: str, first: bool) -> str:
        """A tier's ``path`` in the form it is kept in (``first``: the tier snapshots land on); ConfigError why not."""

    def check_tier(self, tier: Tier) -> tuple[str, str]:
        """(key, why) a tier here is configured wrongly, or ("", "")."""
        if tier.endpoint or tier.region:
            key = "endpoint" if tier.endpoint else "region"
            return key, f"{getattr(tier, key)!r} must be a string, and only an s3:// tier has one"
        return "", ""

    def check_next(self, tier: Tier, after: Tier) -> tuple[str, str]:
        """(key, why) ``after`` must not come right after ``tier``, a tier here, or ("", "")."""
        return "", ""


class WritableStorage(Storage):
    """A storage whose files take bytes from memory, at any offset (step 2: ``write``)."""

    @abstractmethod
    def write(self, handle: Any, offset: int, data: memoryview) -> None: ...


class UploadedStorage(Storage):
    """A storage whose files are uploaded in parts from a local file (step 2: ``upload``)."""

    part: ClassVar[int]
    """Bytes of one part (the last of a file may be shorter); an upload's offsets are multiples of it."""
    max_parts: ClassVar[int]
    """The most parts of one file."""

    @abstractmethod
    def replaced(self, folder: str, paths: Iterable[str]) -> str:
        """The first of ``paths`` (in ``folder``), each uploaded by this writer, that is no longer what its upload
        made (another writer's since), or "" if none is; each is forgotten by this writer."""

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
        raise InvalidRequestError(f"unknown scheme {scheme!r}: no storage backend for it (known: {sorted(_BUILT_IN)})")
    return cls


def backend_for(path: str | os.PathLike) -> Storage:
    """The shared instance of ``path``'s backend, with no options: for reading, and for what its storage can do."""
    cls = backend_class(path)
    if cls not in _SHARED:
        _SHARED[cls] = cls()
    return _SHARED[cls]
