"""Client-owned /dev/shm segments that storages are copied into (``cpu_capture="shm"``, and GPU storages the
daemon cannot open through CUDA IPC).

Where the daemon cannot read the trainer in place, it maps POSIX shared memory instead.
The trainer's own storages stay where they are (moving them into /dev/shm would change
them under the user: a resize crashes, numpy views dangle, ``from_numpy`` tensors stop
following their array); each snapshot copies them into segments this client owns. A
segment is reused once the daemon has copied the snapshot that used it, so a steady loop
allocates its segments once, and the daemon's mappings of them (its region cache) are
reused too. The copy costs the trainer one memcpy per snapshot, as DCP's staging does.
"""

from __future__ import annotations

import os
import threading

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


class SegmentPool:
    """This client's segments by size: those free for the next snapshot, and the trainer-facing copy into one."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()  # snapshot() takes, the connection's thread gives back

    def copy_in(self, storage: torch.UntypedStorage) -> tuple[torch.UntypedStorage, str]:
        """A segment holding a copy of ``storage`` now, and its /dev/shm name; SharedMemoryError if none fits."""
        nbytes = storage.nbytes()
        with self._lock:
            free = self._free.get(nbytes)
            segment = free.pop() if free else None
        if segment is None:
            segment = _new_segment(nbytes)
        # from a CUDA storage too (gpu_capture's host path): copy_ waits for the kernels queued before it
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        torch.empty(0, dtype=torch.uint8).set_(segment).copy_(source)
        return segment, segment._share_filename_cpu_()[1].decode()

    def give_back(self, segments: list[torch.UntypedStorage]) -> None:
        """Segments whose snapshot the daemon has copied (or will never read again): free for reuse."""
        with self._lock:
            for segment in segments:
                self._free.setdefault(segment.nbytes(), []).append(segment)

    def clear(self) -> None:
        """Drop every free segment: torch unlinks each once nothing maps it."""
        with self._lock:
            self._free.clear()


def _new_segment(nbytes: int) -> torch.UntypedStorage:
    """A fresh ``nbytes`` segment in /dev/shm.

    A segment that does not fit raises SharedMemoryError before any byte is written. torch
    reserves the segment's blocks (posix_fallocate) when it creates it, so a segment that a
    concurrent process fills first fails here too, as the same error, never as a SIGBUS.
    """
    free, total, block = _shm_space()
    if _segment_bytes(nbytes, block) > free:
        raise _does_not_fit(nbytes, free, total)
    try:
        segment = torch.UntypedStorage._new_using_filename_cpu(nbytes)
    except RuntimeError as exc:
        if "No space left on device" in str(exc):
            free, total, _block = _shm_space()
            raise _does_not_fit(nbytes, free, total) from None
        raise SharedMemoryError(f"cannot make a {nbytes}-byte segment in {SHM_DIR}: {exc}") from None
    name = segment._share_filename_cpu_()[1].decode()
    if not os.path.exists(segment_path(name)):
        raise SharedMemoryError(f"torch made a shared storage, but not as a named segment ({name!r})")
    return segment
