"""What a snapshot describes on the wire: byte sources by handle, and typed entries.

Tensor payloads never travel as bytes. A ``SourceDesc`` names memory the daemon can read
(an address in the trainer, a POSIX shared-memory segment, a CUDA IPC block); an ``EntryDesc`` says which
state provider turns which bytes into which object. The same entry dicts, checked by
their provider, become the index of the file on disk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError
from .storage import backend_for

VM = "vm"
"""Source kind: an address in the client's own memory, which the daemon reads in place (process_vm_readv)."""

SHM = "shm"
"""Source kind: a POSIX shared-memory segment under /dev/shm, named as torch names them."""

EMPTY = "empty"
"""Source kind: a zero-byte storage, which has no segment at all."""

CUDA_IPC = "cuda_ipc"
"""Source kind: one storage inside a CUDA caching-allocator block, opened through CUDA IPC."""


@dataclass(frozen=True)
class SourceDesc:
    """One storage of the trainer: ``nbytes`` bytes behind ``handle`` of ``kind``."""

    kind: str
    handle: str
    nbytes: int


@dataclass(frozen=True)
class Fence:
    """The ordering point of a snapshot on one GPU: an interprocess CUDA event the trainer recorded at
    ``snapshot()`` on that device's current stream. The daemon copies that device's storages only once
    the event has completed, so every kernel queued on that stream before ``snapshot()`` is in the bytes."""

    uuid: str
    """The device's UUID (CUDA_VISIBLE_DEVICES numbers devices differently in each process)."""
    event: bytes
    """The event's ``cudaIpcEventHandle_t``: exactly 64 bytes."""


@dataclass(frozen=True)
class EntryDesc:
    """One captured leaf of the state, to be planned and restored by provider ``provider``.

    ``meta`` is the provider's own, checked by that provider (a tensor's dtype, shape,
    stride and storage; an object's pickled bytes).
    """

    provider: str
    name: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ranks:
    """Where a client sits in its job; the daemon commits a tag once every rank of ``job`` has."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    job: str = ""
    """Names the job (torchrun's run id, Slurm's job id), so two jobs on one node never share a tag."""

    def check(self) -> Ranks:
        ok = (
            0 <= self.rank < self.world_size
            and 0 <= self.local_rank < self.local_world_size <= self.world_size
            and 0 <= self.node_rank < self.num_nodes <= self.world_size
            and len(self.job) <= 128
        )
        if not ok:
            raise InvalidRequestError(f"inconsistent ranks {self}: each index must be below its size")
        return self


@dataclass(frozen=True)
class Tier:
    """One level of storage (node.yaml's ``storage.tiers``), as the daemon also announces it in WELCOME.

    Snapshots land on the first tier and the daemon copies each committed tag down the
    rest; clients map a tag's folder across the tiers to read the fastest committed copy.
    """

    name: str
    path: str
    keep_last: int | None = None
    """Committed tags kept beside each other on this tier (None: the storage-wide keep_last)."""
    shared: bool = True
    """Every node sees this tier (a parallel file system); false for a node-local disk or /dev/shm.
    Only shared tiers decide which tag a multi-node job restores."""
    endpoint: str = ""
    """An object store tier's server (``https://host:port``); '': the AWS environment's (protocol/storage/s3/)."""
    region: str = ""
    """An object store tier's region; '': the AWS environment's."""

    def place(self, path: str, home: Tier) -> str:
        """``path``, which lies in tier ``home``, at the same place below this tier: where its copy goes."""
        below = os.path.normpath(os.path.relpath(path, home.path))
        return backend_for(self.path).join(self.path, below)
