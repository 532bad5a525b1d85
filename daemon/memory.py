"""The host-memory budget: a fixed pool of reusable, page-aligned chunks.

Chunks are mapped on first use, up to ``host_memory / chunk_size`` of them, and never
freed or re-allocated afterwards: memory touched for the first time is slow here, and
peers leak exactly where per-save buffers are allocated and freed on other threads. A
copy that finds the pool empty waits for a flush to return one. Returned chunks go to the
waiting owners (one client, one rank) in turns (daemon/turns.py), so a rank with a huge
snapshot never starves a rank with a small one.

A fresh daemon maps the rest of its pool in the background (``prefill``), but only while no
copy is under way: a trainer starting seconds after its daemon takes its first snapshot
while the pool is still being mapped, and the mapping competed with that snapshot's copies
for the CPU and for a copy thread. The copies take the chunks already mapped, and map the
ones they still need themselves, in the order they need them.
All methods run on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import warnings
from concurrent.futures import Executor

import torch

from datastates.protocol.fileio import MADV_POPULATE_WRITE

from .pagelock import page_lock
from .turns import Turns

log = logging.getLogger(__name__)


def _anonymous(size: int) -> mmap.mmap:
    """``size`` bytes of anonymous memory, every page mapped now, in base pages. Not in transparent huge pages:
    copies into those ran 5% faster here, but a huge page may be memory the machine never touched before (on a
    VM the hypervisor backs it at that first touch; on a fragmented host the kernel compacts memory for it, in
    the faulting thread): mapping 1 GiB of them took 0.1 s or 0.6-2.2 s, at random, where base pages, freed and
    reused all the time, took 0.25 s every time. A fresh daemon's first snapshot waited on that (its fence took
    1.1-1.3 s for 1 GiB, 15 x a later one's); making them huge later cost 2.4 s of CPU per GiB."""
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: map the pages by touching them
        for at in range(0, size, mmap.PAGESIZE):
            buf[at] = 0
    return buf


class Chunk:
    """One page-aligned buffer, seen both as bytes (for writes) and as a uint8 tensor (for copies).

    ``pinned`` page-locks it once, where CUDA is present, so device-to-host copies into it
    are asynchronous; the CPU path copies into the same chunks, so there is one pool, not two.
    """

    def __init__(self, size: int, pinned: bool = False) -> None:
        self.size = size
        self._map = _anonymous(size)
        self.view = memoryview(self._map)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        self.pin_error = ""
        """Why page-locking it failed: the chunk serves unpinned (GPU copies into it are synchronous)."""
        if pinned:
            try:
                self.pinned = page_lock(self.tensor)
            except RuntimeError as exc:
                self.pin_error = str(exc)


class Window:
    """Bytes ``at..at+length`` of memory the daemon writes a file from (a replica's own pages), in a chunk's
    shape, so a copy fills them in place of a pool chunk."""

    def __init__(self, tensor: torch.Tensor, view: memoryview, at: int, length: int) -> None:
        self.tensor = tensor[at:at + length]
        self.view = view[at:at + length]


class HostPool:
    def __init__(self, chunk_size: int, chunks: int, pinned: bool = False) -> None:
        self.chunk_size = chunk_size
        self.capacity = chunks
        self.pinned = pinned
        self._all: list[Chunk] = []
        self._free: list[Chunk] = []
        self._turns: Turns[Chunk] = Turns(self._free.append)
        """Copies waiting for a chunk, served in turns between owners."""
        self.peak_in_use = 0
        self._flushing: set[int] = set()
        """Chunks (by id) whose copy is done, held until their bytes are written (``copied``)."""
        self._mapping = 0
        self._copying: set[int] = set()
        """Chunks (by id) handed to a copy that has not finished with them yet (``copied`` or ``release``)."""
        self._acquiring = 0
        self._no_copies = asyncio.Event()
        """Set while no copy holds or waits for a chunk: the only time ``prefill`` maps one."""
        self._no_copies.set()
        self.pin_error = ""
        """Why page-locking a chunk failed (RLIMIT_MEMLOCK, a driver refusing): later chunks are not pinned."""

    def _new(self, chunk: Chunk) -> Chunk:
        if chunk.pin_error and not self.pin_error:
            self.pin_error, self.pinned = chunk.pin_error, False
            log.warning("page-locking the host pool failed (%s): GPU copies go on, synchronously, into pageable "
                        "memory; status shows it as host_memory.pin_error", chunk.pin_error)
        self._all.append(chunk)
        return chunk

    @property
    def in_use(self) -> int:
        return len(self._all) - len(self._free)

    def _room(self) -> bool:
        return len(self._all) + self._mapping < self.capacity

    async def prefill(self, executor: Executor) -> None:
        """Map every chunk not mapped yet, one at a time on ``executor`` (a thread no copy uses), each only while
        no copy is under way; each chunk serves copies as soon as it is ready."""
        loop = asyncio.get_running_loop()
        while True:
            await self._no_copies.wait()
            if not self._room():
                return
            self._mapping += 1
            try:
                chunk = await loop.run_in_executor(executor, Chunk, self.chunk_size, self.pinned)
            finally:
                self._mapping -= 1
            self.release(self._new(chunk))

    def _copies_changed(self) -> None:
        if self._copying or self._acquiring:
            self._no_copies.clear()
        else:
            self._no_copies.set()

    async def acquire(self, owner: str = "") -> Chunk:
        """A chunk for one copy, which hands it back with ``copied`` (then ``release``) or ``release``."""
        self._acquiring += 1
        self._copies_changed()
        try:
            chunk = await self._take(owner)
            self._copying.add(id(chunk))
        finally:
            self._acquiring -= 1
            self._copies_changed()
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        return chunk

    async def _take(self, owner: str) -> Chunk:
        if self._free and not self._turns:
            chunk = self._free.pop()
        elif self._room() and not self._turns:  # mapped (and page-locked: a CUDA call) off the event loop
            self._mapping += 1
            try:
                chunk = self._new(await asyncio.get_running_loop().run_in_executor(None, Chunk, self.chunk_size,
                                                                                   self.pinned))
            finally:
                self._mapping -= 1
        else:
            chunk = await self._turns.wait(owner)
        return chunk

    def copied(self, chunk: Chunk) -> None:
        """``chunk`` holds its piece now: until ``release``, status counts it waiting to be flushed, not copying."""
        self._flushing.add(id(chunk))
        self._copying.discard(id(chunk))
        self._copies_changed()

    def release(self, chunk: Chunk) -> None:
        """Hand ``chunk`` to the next owner in turn that still waits, or back to the free list."""
        self._flushing.discard(id(chunk))
        self._copying.discard(id(chunk))
        self._copies_changed()
        if not self._turns.hand(chunk):
            self._free.append(chunk)

    def status(self) -> dict[str, int | str]:
        """The pool by what its chunks do: every chunk is copying, flushing or free (mapped or not yet)."""
        return {
            "budget_bytes": self.capacity * self.chunk_size,
            "chunk_size": self.chunk_size,
            "chunks_allocated": len(self._all),
            "chunks_in_use": self.in_use,
            "chunks_copying": self.in_use - len(self._flushing),
            "chunks_flushing": len(self._flushing),
            "chunks_free": self.capacity - self.in_use,
            "chunks_pinned": sum(c.pinned for c in self._all),
            "pin_error": self.pin_error,
            "peak_in_use_bytes": self.peak_in_use * self.chunk_size,
            "waiting_copies": self._turns.waiting(),
        }
