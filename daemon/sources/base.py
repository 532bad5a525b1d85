"""Copy sources: memory of a trainer that the daemon can read without the trainer's help.

Call order: the server calls ``open(desc, owner)`` once per handle and client, when a
SNAPSHOT is admitted; copy threads then call ``Region.read_into``. A region stays open while
any job or the client's region cache references it, and is closed when the last reference
goes. Three kinds: the trainer's CPU memory read in place (``vm``, the default), POSIX
shared memory (``shm``, the fallback, which survives the trainer) and CUDA IPC.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import ctypes
from dataclasses import dataclass
from typing import ClassVar, Hashable, Protocol, Sequence

import torch

from datastates.protocol.descriptors import SourceDesc
from datastates.protocol.errors import InvalidRequestError


class Pending(Protocol):
    """A copy still in flight (a CUDA event): the copy thread waits on it before it checksums the bytes."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Owner:
    """The client process a snapshot's sources belong to, as the daemon checked it at HELLO."""

    pid: int
    started: str | None
    """Its start time, when the daemon watches its pid (same host and pid namespace); else None."""
    readable: str
    """Why the daemon cannot read its memory in place; "" when it can (the HELLO probe passed)."""


class Region(ABC):
    """``nbytes`` bytes the daemon reads with ``read_into``; ``tensor``, a flat uint8 view of them, only where
    torch can copy them itself (the base ``read_into``): memory read in place or through a descriptor has none."""

    nbytes: int
    tensor: torch.Tensor
    in_trainer: ClassVar[bool] = False
    """Memory that lives in the trainer process (its GPU memory, or its CPU memory read in place): unreadable
    once the trainer exits, unlike shared memory, which the daemon's own mapping keeps."""
    fenced: ClassVar[bool] = False
    """GPU memory: read only once the snapshot's fences completed (the kernels queued before ``snapshot()``)."""

    def batch_key(self) -> Hashable | None:
        """Regions with one equal key are read together by ``read_batch`` (one system call for many small
        tensors of one trainer, not one each); None: this region is read alone."""
        return None

    @staticmethod
    def read_batch(reads: Sequence[tuple[Region, int, int, int]]) -> None:
        """``(region, dst address, src, length)`` reads of regions of one ``batch_key`` into host memory;
        raises SnapshotFailedError as ``read_into`` would."""
        raise NotImplementedError

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> Pending | None:
        """Copy ``length`` bytes at ``src`` into the host tensor ``dst``; a Pending if the copy is asynchronous.

        A host region copies at once (a memcpy that releases the GIL); a device region
        queues the copy on the daemon's own stream, so a thread issues all of a piece's
        copies before it waits on any.
        """
        dst[:length].copy_(self.tensor[src:src + length])
        return None

    def destination(self, dst: torch.Tensor, src: int, length: int) -> memoryview:
        """``length`` writable bytes at the start of host tensor ``dst``, for a region read by a system call
        (``pread``, ``process_vm_readv``); ValueError unless ``src..src+length`` lies in the region."""
        if not 0 <= src <= src + length <= self.nbytes or length > dst.numel() or not dst.is_contiguous():
            raise ValueError(f"read of {length} bytes at {src} does not fit a {self.nbytes}-byte region "
                             f"and a {dst.numel()}-byte destination")
        return memoryview((ctypes.c_char * length).from_address(dst.data_ptr())).cast("B")


class CopySource(ABC):
    kind: ClassVar[str]

    @abstractmethod
    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        """Map the memory ``desc`` names in ``owner``; raises SharedMemoryError or InvalidRequestError."""


_SOURCES: dict[str, CopySource] = {}


def register_source(source: CopySource) -> CopySource:
    _SOURCES[source.kind] = source
    return source


def open_region(desc: SourceDesc, owner: Owner) -> Region:
    source = _SOURCES.get(desc.kind)
    if source is None:
        raise InvalidRequestError(f"unknown source kind {desc.kind!r} (known: {sorted(_SOURCES)})")
    if desc.nbytes < 0:
        raise InvalidRequestError(f"source {desc.handle!r} declares a negative size")
    return source.open(desc, owner)
