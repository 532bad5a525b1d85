"""POSIX shared-memory regions (``cpu_capture="shm"``), as torch's file_system sharing names them."""

from __future__ import annotations

import os
import re
import stat
import weakref

import torch

from datastates.protocol.descriptors import EMPTY, SHM, SourceDesc
from datastates.protocol.errors import InvalidRequestError, SharedMemoryError
from datastates.protocol.paths import SHM_DIR

from .base import CopySource, Owner, Region, register_source

MAX_PREFIX = 4096
"""torch puts a small refcount block in front of the data; anything larger means a wrong size."""

_NAME_RE = re.compile(r"^/?[A-Za-z0-9_.-]{1,250}$")


class ShmRegion(Region):
    """A segment read with ``pread`` through one descriptor, never mapped.

    The descriptor keeps the segment's pages readable after the trainer (or torch's
    manager) unlinks it, so a snapshot of shared memory survives the trainer; and a client
    that shrinks its segment after admission gets a short read, which fails that one
    snapshot, where a mapping would have killed the daemon with SIGBUS.
    """

    def __init__(self, name: str, nbytes: int) -> None:
        path = os.path.join(SHM_DIR, name.lstrip("/"))
        try:
            # O_NONBLOCK: a FIFO named as a segment opens at once (then fails the check below) instead of
            # blocking an admission thread until some writer opens it
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise SharedMemoryError(f"cannot open shared-memory segment {name!r}: {exc.strerror}", handle=name) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise SharedMemoryError(f"segment {name!r} is not a regular file owned by the daemon's user "
                                        f"({stat.filemode(st.st_mode)}, uid {st.st_uid})", handle=name)
            prefix = st.st_size - nbytes
            if not 0 <= prefix <= MAX_PREFIX:
                raise InvalidRequestError(
                    f"segment {name!r} holds {st.st_size} bytes, which does not fit a {nbytes}-byte storage", handle=name
                )
        except BaseException:
            os.close(fd)
            raise
        self.name = name
        self.nbytes = nbytes
        self._fd = fd
        self._prefix = prefix
        weakref.finalize(self, os.close, fd)

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> None:
        buf = self.destination(dst, src, length)
        done = 0
        while done < length:
            n = os.preadv(self._fd, [buf[done:]], self._prefix + src + done)  # releases the GIL, as a memcpy
            if n == 0:
                raise SharedMemoryError(f"segment {self.name!r} shrank below its {self.nbytes} bytes while it was "
                                        "being copied: its client truncated it", handle=self.name)
            done += n
        return None


class _EmptyRegion(Region):
    def __init__(self) -> None:
        self.nbytes = 0
        self.tensor = torch.empty(0, dtype=torch.uint8)


class ShmSource(CopySource):
    kind = SHM

    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        if not _NAME_RE.match(desc.handle):
            raise InvalidRequestError(f"bad shared-memory handle {desc.handle[:300]!r}")
        if desc.nbytes == 0:
            raise InvalidRequestError("a shared-memory source must not be empty; use kind 'empty'")
        return ShmRegion(desc.handle, desc.nbytes)


class EmptySource(CopySource):
    kind = EMPTY

    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        if desc.nbytes != 0:
            raise InvalidRequestError(f"an empty source declares {desc.nbytes} bytes")
        return _EmptyRegion()


register_source(ShmSource())
register_source(EmptySource())
