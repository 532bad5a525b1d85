"""Storage writers: where and how checkpoint bytes become durable files.

Call order, every call from a flush thread:
1. ``create(path, token)`` opens a temporary file beside ``path``;
2. ``write(handle, offset, data)`` any number of times, in any order;
3. ``finalize(handle)`` makes the file durable and visible at ``path`` (fsync, rename,
   fsync of the folder), or ``abort(handle)`` removes every trace of it;
4. ``publish(path, data)`` writes a small file (a commit marker) with the same guarantees.

A writer raises StorageError, whose message names the path and the cause (disk full,
read-only, I/O error). Writers are picked by URL scheme; plain paths are ``file``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from datastates.protocol.errors import InvalidRequestError


class StorageWriter(ABC):
    scheme: ClassVar[str]

    @abstractmethod
    def create(self, path: str, token: str) -> Any: ...

    @abstractmethod
    def write(self, handle: Any, offset: int, data: memoryview) -> None: ...

    @abstractmethod
    def finalize(self, handle: Any) -> None: ...

    @abstractmethod
    def abort(self, handle: Any) -> None: ...

    @abstractmethod
    def publish(self, path: str, data: bytes) -> None: ...


_WRITERS: dict[str, StorageWriter] = {}


def register_writer(writer: StorageWriter) -> StorageWriter:
    _WRITERS[writer.scheme] = writer
    return writer


def writer_for(path: str) -> StorageWriter:
    scheme = path.split("://", 1)[0] if "://" in path else "file"
    writer = _WRITERS.get(scheme)
    if writer is None:
        raise InvalidRequestError(f"no storage writer for scheme {scheme!r} (known: {sorted(_WRITERS)})")
    return writer
