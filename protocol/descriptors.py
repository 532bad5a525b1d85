"""What a snapshot describes on the wire: byte sources by handle, and typed entries.

Tensor payloads never travel as bytes. A ``SourceDesc`` names memory the daemon can map
(a POSIX shared-memory segment now, a CUDA IPC block later); an ``EntryDesc`` says which
state provider turns which bytes into which object. The same entry dicts, checked by
their provider, become the index of the file on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SHM = "shm"
"""Source kind: a POSIX shared-memory segment under /dev/shm, named as torch names them."""

EMPTY = "empty"
"""Source kind: a zero-byte storage, which has no segment at all."""


@dataclass(frozen=True)
class SourceDesc:
    """One storage of the trainer: ``nbytes`` bytes behind ``handle`` of ``kind``."""

    kind: str
    handle: str
    nbytes: int


@dataclass(frozen=True)
class EntryDesc:
    """One captured leaf of the state, to be planned and restored by provider ``provider``.

    ``meta`` is the provider's own, checked by that provider (a tensor's dtype, shape,
    stride and storage; an object's pickled bytes).
    """

    provider: str
    name: str
    meta: dict[str, Any] = field(default_factory=dict)
