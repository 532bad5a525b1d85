"""Committed replicas' pages locked in memory (``mlock``), on a thread of their own.

A memory restore maps a replica's pages copy-on-write, and the kernel maps 16 of them per
fault (fault-around). Two things undo that, and a locked page is safe from both:

- a global ``echo 3 > /proc/sys/vm/drop_caches`` (benchmarks and some cluster epilogues
  run it) flags every dirty tmpfs page it cannot drop for reclaim, and fault-around skips
  flagged pages (the flag is the one readahead uses): from then on every restore of that
  replica takes a fault per 4 KiB page, 2 x its time (measured, Linux 6.18). The kernel
  leaves unevictable pages alone;
- memory pressure swaps replica pages out where the node has swap (zram): a memory restore
  would then read swap.

A lock lasts as long as the daemon's mapping of the file: it goes when the replica is
superseded or discarded, or the daemon exits. Locking is best effort: beyond
RLIMIT_MEMLOCK (8 MiB for a user by default; unlimited on most HPC nodes, for RDMA, and
for root), replicas serve restores unlocked, as before, and ``status`` says how much is locked.
Mapping and locking a large replica takes tens of milliseconds per GB, so it runs on this
thread, never on the server loop; one thread keeps each replica's lock and unlock in order.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import resource
from concurrent.futures import ThreadPoolExecutor

import numpy as np

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Pins:
    """Each committed replica's file mapped and locked, by its snapshot (job id), until ``unpin``."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ds-pin")
        self._held: dict[int, mmap.mmap] = {}
        self.locked_bytes = 0
        self.refused = ""
        """Why the last lock failed (RLIMIT_MEMLOCK, memory), or "": for ``status``."""

    def pin(self, job_id: int, file: str, size: int) -> None:
        self._thread.submit(self._pin, job_id, file, size)

    def unpin(self, job_id: int) -> None:
        self._thread.submit(self._unpin, job_id)

    def close(self) -> None:
        """Unlock everything: the replicas' files go next."""
        for job_id in list(self._held):
            self.unpin(job_id)
        self._thread.shutdown(wait=True)

    def _pin(self, job_id: int, file: str, size: int) -> None:
        if job_id in self._held or size <= 0:
            return
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # discarded already: its unpin is queued behind
            return
        try:
            if os.fstat(fd).st_size < size:
                return
            pages = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        address = np.frombuffer(pages, dtype=np.uint8).ctypes.data
        if _libc.mlock(address, size) != 0:
            err = ctypes.get_errno()
            pages.close()
            if not self.refused:
                log.warning("replica %s not locked in memory (mlock: %s; RLIMIT_MEMLOCK %s): memory restores still "
                            "work, but a global drop of caches or swapping can make them slower; raise `ulimit -l`",
                            file, os.strerror(err), _memlock_limit())
            self.refused = os.strerror(err)
            return
        self._held[job_id] = pages
        self.locked_bytes += size

    def _unpin(self, job_id: int) -> None:
        pages = self._held.pop(job_id, None)
        if pages is not None:
            self.locked_bytes -= len(pages)
            pages.close()  # munmap unlocks


def _memlock_limit() -> str:
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
