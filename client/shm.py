"""Moving a trainer's CPU storages into POSIX shared memory, once.

torch's file_system sharing (``UntypedStorage._share_filename_cpu_``) swaps a storage's
memory for a named /dev/shm segment in place, for every view of it, as
``Tensor.share_memory_()`` does; it is a no-op for a storage already shared that way. So
the first snapshot of a tensor pays one copy in the trainer and every later one none.
"""

from __future__ import annotations

import os

import torch

from datastates.protocol.errors import SharedMemoryError
from datastates.protocol.paths import SHM_DIR



def segment_path(name: str) -> str:
    return SHM_DIR + "/" + name.lstrip("/")


SEGMENT_PREFIX = 64
"""torch's refcount block in front of a segment's data (its ``map_alloc_alignment``)."""


def _shm_space() -> tuple[int, int, int]:
    """Free bytes, total bytes and block size of /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, st.f_frsize or 4096


def _segment_bytes(nbytes: int, block: int) -> int:
    """What a segment for an ``nbytes`` storage takes in /dev/shm: its prefix too, in whole blocks."""
    return -(-(nbytes + SEGMENT_PREFIX) // block) * block


def _does_not_fit(nbytes: int, free: int, total: int) -> SharedMemoryError:
    return SharedMemoryError(
        f"a {nbytes}-byte ({nbytes / 2**20:.1f} MiB) storage does not fit in {SHM_DIR} "
        f"({free} bytes free of {total}); enlarge it (docker run --shm-size=..., "
        f"or mount -o remount,size=... {SHM_DIR})",
        nbytes=nbytes, free=free,
    )


def share(storage: torch.UntypedStorage) -> str:
    """The /dev/shm name of ``storage``, moving it into shared memory if it is not there yet.

    A storage that does not fit raises SharedMemoryError before any byte is moved. torch
    reserves the segment's blocks (posix_fallocate) before it copies, so a segment that a
    concurrent process fills first fails here too, as the same error, never as a SIGBUS.
    """
    nbytes = storage.nbytes()
    moving = not storage.is_shared()
    if moving:
        free, total, block = _shm_space()
        if _segment_bytes(nbytes, block) > free:
            raise _does_not_fit(nbytes, free, total)
    try:
        _manager, name, _size = storage._share_filename_cpu_()
    except RuntimeError as exc:
        if "No space left on device" in str(exc):
            free, total, _block = _shm_space()
            raise _does_not_fit(nbytes, free, total) from None
        raise SharedMemoryError(f"cannot move a {nbytes}-byte storage into shared memory: {exc}") from None
    name = name.decode()
    if moving and not os.path.exists(segment_path(name)):  # later snapshots skip the stat: the hot path
        raise SharedMemoryError(f"storage is shared, but not through a named segment ({name!r})")
    return name
