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

SHM_DIR = "/dev/shm"


def segment_path(name: str) -> str:
    return SHM_DIR + "/" + name.lstrip("/")


def _free_shm_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def share(storage: torch.UntypedStorage) -> str:
    """The /dev/shm name of ``storage``, moving it into shared memory if it is not there yet."""
    nbytes = storage.nbytes()
    moving = not storage.is_shared()
    if moving and nbytes > _free_shm_bytes():
        raise SharedMemoryError(
            f"a {nbytes}-byte storage does not fit in {SHM_DIR} ({_free_shm_bytes()} bytes free); "
            "enlarge it (docker run --shm-size=..., or mount -o remount,size=... /dev/shm)",
            nbytes=nbytes,
        )
    try:
        _manager, name, _size = storage._share_filename_cpu_()
    except RuntimeError as exc:
        raise SharedMemoryError(f"cannot move a {nbytes}-byte storage into shared memory: {exc}") from None
    name = name.decode()
    if moving and not os.path.exists(segment_path(name)):  # later snapshots skip the stat: the hot path
        raise SharedMemoryError(f"storage is shared, but not through a named segment ({name!r})")
    return name
