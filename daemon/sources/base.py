"""Copy sources: memory of a trainer that the daemon can read without the trainer's help.

Call order: the server calls ``open(desc)`` once per handle and client, when a SNAPSHOT is
admitted; copy threads then read ``Region.tensor``. A region stays mapped while any job or
the client's region cache references it, and is unmapped when the last reference goes,
so the daemon's copy survives the trainer. Shared memory is the CPU kind; CUDA IPC plugs
in as another kind without changes elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from datastates.protocol.descriptors import SourceDesc
from datastates.protocol.errors import InvalidRequestError


class Pending(Protocol):
    """A copy still in flight (a CUDA event): the copy thread waits on it before it checksums the bytes."""

    def synchronize(self) -> None: ...


class Region(ABC):
    """Bytes the daemon reads: ``tensor`` is a flat uint8 view of exactly ``nbytes``."""

    nbytes: int
    tensor: torch.Tensor
    device_memory: ClassVar[bool] = False
    """Trainer GPU memory: never cached (a held region keeps it alive in the trainer), and unreadable
    once the trainer exits, unlike shared memory, which the daemon's own mapping keeps."""

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> Pending | None:
        """Copy ``length`` bytes at ``src`` into the host tensor ``dst``; a Pending if the copy is asynchronous.

        A host region copies at once (a memcpy that releases the GIL); a device region
        queues the copy on the daemon's own stream, so a thread issues all of a piece's
        copies before it waits on any.
        """
        dst[:length].copy_(self.tensor[src:src + length])
        return None


class CopySource(ABC):
    kind: ClassVar[str]

    @abstractmethod
    def open(self, desc: SourceDesc) -> Region:
        """Map the memory ``desc`` names; raises SharedMemoryError or InvalidRequestError."""


_SOURCES: dict[str, CopySource] = {}


def register_source(source: CopySource) -> CopySource:
    _SOURCES[source.kind] = source
    return source


def open_region(desc: SourceDesc) -> Region:
    source = _SOURCES.get(desc.kind)
    if source is None:
        raise InvalidRequestError(f"unknown source kind {desc.kind!r} (known: {sorted(_SOURCES)})")
    if desc.nbytes < 0:
        raise InvalidRequestError(f"source {desc.handle!r} declares a negative size")
    return source.open(desc)
