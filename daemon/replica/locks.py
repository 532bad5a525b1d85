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

A lock lasts as long as the daemon's mapping of the file. A superseded replica kept as its
rank file's spare keeps it, and hands it to the next replica written over its pages
(``move``): locking the new replica and unlocking the old one every checkpoint walked every
page twice, 0.05 of the daemon's 0.33 CPU-s for a 0.76 GB state (perf, measured here). It
goes when the replica or spare is discarded, or the daemon exits. Locking is best effort: beyond
RLIMIT_MEMLOCK (8 MiB for a user by default; unlimited on most HPC nodes, for RDMA, and
for root), replicas serve restores unlocked, as before, and ``status`` says how much is locked.
Mapping and locking a large replica takes tens of milliseconds per GB, so it runs on this
thread, never on the server loop; one thread keeps each replica's lock and unlock in order.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import resource
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Hashable

import numpy as np

log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class PageLocks:
    """Each committed replica's file mapped and locked, by its snapshot (job id), or by a spare's key once it is
    a spare, until ``unpin``."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ds-pin")
        self._held: dict[Hashable, tuple[mmap.mmap, int]] = {}
        """job id (or spare key) → the locked mapping, and the file's descriptor (its link count says when the file
        was removed)."""
        self._closed = False
        self.locked_bytes = 0
        self._queued = 0
        self._queued_lock = threading.Lock()
        self.refused = ""
        """Why the last lock failed (RLIMIT_MEMLOCK, memory), or "": for ``status``."""

    def pin(self, job_id: Hashable, file: str, size: int) -> None:
        """Lock ``file``'s first ``size`` bytes for ``job_id``; nothing to do where the lock it holds already
        (handed over by ``move``) covers that size."""
        self._submit(self._pin, job_id, file, size)

    def unpin(self, job_id: Hashable) -> None:
        self._submit(self._unpin, job_id)

    def move(self, old: Hashable, new: Hashable) -> None:
        """The lock held for ``old`` (if any) is ``new``'s now: the same file, renamed (a replica become a spare, a
        spare become the next replica's file)."""
        self._submit(self._move, old, new)

    def release_removed(self) -> None:
        """Unlock the replicas whose file was removed under the daemon (its /dev/shm folder cleaned up by
        someone else): their replica serves no restore, and their pages are freed only once unmapped."""
        self._submit(self._sweep)

    @property
    def pending(self) -> int:
        """Locks, unlocks and hand-overs queued and not done yet: ``locked_bytes`` is settled at 0."""
        return self._queued

    def _submit(self, step: Callable[..., None], *args: Any) -> None:
        if not self._closed:
            with self._queued_lock:
                self._queued += 1
            self._thread.submit(self._logged, step, *args)

    def close(self) -> None:
        """Unlock everything, the locks still queued left undone: the replicas' files go next."""
        self._closed = True
        self._thread.shutdown(wait=True, cancel_futures=True)
        for job_id in list(self._held):
            self._unpin(job_id)

    def _logged(self, step: Callable[..., None], *args: Any) -> None:
        try:
            step(*args)
        except Exception:  # noqa: BLE001 - a lock is an optimization: it never fails a commit or a restore
            log.exception("locking replica pages failed")
        finally:
            with self._queued_lock:
                self._queued -= 1

    def _pin(self, job_id: Hashable, file: str, size: int) -> None:
        held = self._held.get(job_id)
        if held is not None and len(held[0]) == size and os.fstat(held[1]).st_size == size:
            return
        self._unpin(job_id)  # a lock handed over of another size: the file was cut or grown
        if size <= 0:
            return
        try:
            fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:  # discarded already: its unpin is queued behind
            return
        try:
            if os.fstat(fd).st_size < size:  # cut already: a spare, written over by the next replica
                os.close(fd)
                return
            pages = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        if _libc.mlock(np.frombuffer(pages, dtype=np.uint8).ctypes.data, size) != 0:
            err = ctypes.get_errno()
            pages.close()
            shrank = os.fstat(fd).st_size < size  # cut while locked: a spare written over by the next replica
            os.close(fd)
            if not shrank:
                self._refused(file, size, err)
            return
        self._held[job_id] = (pages, fd)
        self.locked_bytes += size
        self.refused = ""

    def _refused(self, file: str, size: int, err: int) -> None:
        limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
        over = err == errno.EPERM or (limit != resource.RLIM_INFINITY and self.locked_bytes + size > limit)
        why = f"over RLIMIT_MEMLOCK ({limit} bytes; raise `ulimit -l`)" if over else os.strerror(err)
        if self.refused != why:
            log.warning("replica %s not locked in memory: %s. Memory restores still work, but swapping or a global "
                        "drop of caches can make them slower", file, why)
        self.refused = why

    def _move(self, old: Hashable, new: Hashable) -> None:
        held = self._held.pop(old, None)
        if held is not None:
            self._unpin(new)
            self._held[new] = held

    def _unpin(self, job_id: Hashable) -> None:
        held = self._held.pop(job_id, None)
        if held is not None:
            pages, fd = held
            self.locked_bytes -= len(pages)
            pages.close()  # munmap unlocks
            os.close(fd)

    def _sweep(self) -> None:
        for job_id in [j for j, (_, fd) in self._held.items() if os.fstat(fd).st_nlink == 0]:
            self._unpin(job_id)
