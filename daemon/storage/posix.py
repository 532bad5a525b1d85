"""The local / parallel file-system writer: temporary name, pwrite, fsync, rename."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from datastates.protocol.errors import StorageError
from datastates.protocol.format import TEMP_SUFFIX

from .base import StorageWriter, register_writer


def _storage_error(what: str, path: str, exc: OSError) -> StorageError:
    cause = {errno.ENOSPC: "disk full", errno.EROFS: "read-only file system", errno.EDQUOT: "quota exceeded"}.get(
        exc.errno, exc.strerror or str(exc)
    )
    return StorageError(f"{what} {path}: {cause}", path=path, errno=exc.errno or 0)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs_durable(folder: str) -> None:
    """Create ``folder`` and its missing parents, fsyncing each new entry's parent."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    for new in reversed(missing):
        try:
            os.mkdir(new, 0o755)
        except FileExistsError:
            continue
        _fsync_dir(os.path.dirname(new))


def temp_path(path: str, token: str) -> str:
    """The hidden temporary name a file is written under until it is durable."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{token}{TEMP_SUFFIX}")


@dataclass
class _Handle:
    path: str
    temp: str
    fd: int


class PosixWriter(StorageWriter):
    scheme = "file"

    def create(self, path: str, token: str) -> _Handle:
        temp = temp_path(path, token)
        try:
            _makedirs_durable(os.path.dirname(path))
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            raise _storage_error("cannot create", path, exc) from None
        return _Handle(path=path, temp=temp, fd=fd)

    def write(self, handle: _Handle, offset: int, data: memoryview) -> None:
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(handle.fd, data[done:], offset + done)
        except OSError as exc:
            raise _storage_error("cannot write", handle.path, exc) from None

    def finalize(self, handle: _Handle) -> None:
        try:
            os.fsync(handle.fd)
            os.close(handle.fd)
            handle.fd = -1
            os.replace(handle.temp, handle.path)
            _fsync_dir(os.path.dirname(handle.path))
        except OSError as exc:
            self.abort(handle)
            raise _storage_error("cannot make durable", handle.path, exc) from None

    def abort(self, handle: _Handle) -> None:
        if handle.fd >= 0:
            os.close(handle.fd)
            handle.fd = -1
        try:
            os.unlink(handle.temp)
        except FileNotFoundError:
            pass

    def publish(self, path: str, data: bytes) -> None:
        handle = self.create(path, f"{os.getpid()}-{id(data):x}")
        try:
            self.write(handle, 0, memoryview(data))
        except StorageError:
            self.abort(handle)
            raise
        self.finalize(handle)


register_writer(PosixWriter())
