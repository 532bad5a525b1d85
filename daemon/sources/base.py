"""Copy sources: memory of a trainer that the daemon can read without the trainer's help.

Call order: the server calls ``open(desc)`` once per handle and client, when a SNAPSHOT is
admitted; copy threads then read ``Region.tensor``. A region stays mapped while any job or
the client's region cache references it, and is unmapped when the last reference goes,
so the daemon's copy survives the trainer. Shared memory is the CPU kind; CUDA IPC plugs
in as another kind without changes elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from datastates.protocol.descriptors import SourceDesc
from datastates.protocol.errors import InvalidRequestError


class Region(ABC):
    """Bytes the daemon reads: ``tensor`` is a flat uint8 view of exactly ``nbytes``."""

    nbytes: int
    tensor: torch.Tensor


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
