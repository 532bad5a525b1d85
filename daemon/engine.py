"""The pipeline that moves a snapshot from the trainer's memory to a durable file.

Per piece: take a pool chunk → copy into it on a copy thread → write it on a flush thread
→ give the chunk back. Pieces of all snapshots queue for chunks in arrival order, so
copying, checksumming and writing overlap, and host memory never exceeds the pool. A
snapshot with an in-memory replica is copied into the replica's own pages instead (the
chunk only paces it, and goes back once the copy is done), and its file is written from
them: the replica costs no copy of its own. The head, now with every checksum, and the
zip's central directory are written last, then the file is fsynced and renamed.
Copies, writes and header encoding run on the two long-lived executors, never on the
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from datastates.protocol.errors import DatastatesError, SnapshotFailedError
from datastates.protocol.storage import Gone, WritableStorage, backend_class

from .copier import copy_piece, write_hashed
from .instances import daemons_folder
from .job import SnapshotJob
from .memory import Chunk, HostPool, Window
from datastates.protocol.layout import FilePlan, Piece

from .sink import FileSink
from .turns import Slots

log = logging.getLogger(__name__)

FILE_THREADS = 4
"""Threads for the small file-system work (``Engine.flush``): it waits on the metadata server, not on bandwidth."""


class Engine:
    def __init__(self, pool: HostPool, copy_threads: int, flush_threads: int, direct_io: bool, owner: str) -> None:
        self.pool = pool
        self._copy = ThreadPoolExecutor(copy_threads, thread_name_prefix="ds-copy")
        self._copy_turns = Slots(copy_threads)
        """The copy threads, in turns between clients: a thread pool's queue would serve snapshots first come."""
        self._flush = ThreadPoolExecutor(flush_threads, thread_name_prefix="ds-flush")
        self._files = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="ds-files")
        """The small file-system work (a file created, a marker read or written, a listing): never queued behind the
        flush threads' writes, where eight ranks' snapshots waited to be admitted behind the first ones' pieces."""
        self._fence = ThreadPoolExecutor(1, thread_name_prefix="ds-fence")
        """Polls GPU snapshots' fences (a query each, never a wait), so no copy thread waits on a trainer's kernels."""
        self._prefill = ThreadPoolExecutor(1, thread_name_prefix="ds-prefill")
        """Maps a fresh daemon's pool in the background, so no copy waits behind a chunk being mapped."""
        self._deferring = 0
        """Pieces of the snapshots whose replica waits for their last copy (``_defer_replica``): their chunks."""
        self._direct_io = direct_io
        self._owner = owner
        self._writers: dict[type, Any] = {}

    def writer(self, path: str) -> WritableStorage:
        """The one backend instance for ``path``'s scheme, made with the config's options."""
        cls = backend_class(path)
        if cls not in self._writers:
            self._writers[cls] = cls(direct_io=self._direct_io, owner=self._owner, journals=daemons_folder())
        return self._writers[cls]

    async def remove_leftovers(self, roots: list[str], gone: Gone) -> tuple[list[str], set[str]]:
        """What killed daemons of this node (``gone`` owners) left half-written under the roots, deleted; and the
        owners whose leftovers could not all be (``Storage.kept``)."""
        removed: list[str] = []
        for root in roots:
            removed += await self.flush(self.writer(root).remove_leftovers, root, gone)
        return removed, set().union(*(w.kept for w in self._writers.values()))

    async def prefill(self) -> None:
        """Map and touch the whole pool now, between copies, so no later checkpoint pays for it."""
        await self.pool.prefill(self._prefill)

    async def flush(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file-system work that moves few bytes (opens, markers, listings, renames) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._files, fn, *args)

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking work that moves a snapshot's bytes (its pieces, its head, its fsync) on a flush thread."""
        return await asyncio.get_running_loop().run_in_executor(self._flush, fn, *args)

    async def run(self, job: SnapshotJob, after: list[asyncio.Future]) -> None:
        """Carry ``job`` to durable or failed; never raises.

        ``after`` are earlier snapshots of the same path: this one is renamed into place
        only once they are done, so the newest snapshot of a path is the one that stays.
        """
        plan = job.plan
        assert plan is not None
        token = f"{job.client_id}-{job.id}"
        replicas = [] if job.replica is None else [(self.writer(job.replica.file), job.replica.file, job.replica.spare)]
        sink = FileSink(self.writer(plan.path), plan.path, token, replicas)
        sums: list[list[bytes]] = [list(s.checksums) for s in plan.header.storages]
        failures: list[BaseException] = []
        uncopied = len(plan.pieces)
        loop = asyncio.get_running_loop()
        pages: memoryview | None = None
        in_place: torch.Tensor | None = None
        deferred = False
        all_copied = asyncio.Event()

        async def one(piece: Piece) -> None:
            nonlocal uncopied
            if failures:
                return
            chunk: Chunk | None = await self.pool.acquire(job.client_id)
            at = plan.data_offset + piece.offset
            try:
                if failures:
                    return
                if job.abandoned is not None:
                    raise job.abandoned
                filled_in_place = in_place is not None
                dst = Window(in_place, pages, at, piece.length) if filled_in_place else chunk
                async with self._copy_turns.turn(job.client_id):
                    await loop.run_in_executor(self._copy, copy_piece, piece, dst, job.regions, job.before_copy,
                                               job.add_copied)
                uncopied -= 1
                if uncopied == 0:
                    job.mark_copied()
                    all_copied.set()
                if filled_in_place:
                    self.pool.release(chunk)  # it only paced this copy: the bytes are in the replica's pages
                    chunk = None
                else:
                    self.pool.copied(chunk)
                await self.write(write_hashed, sink, piece, dst, at, filled_in_place, sums, not deferred)
                if deferred:
                    await all_copied.wait()
                    if failures:
                        return
                    await self.write(sink.write_replicas, at, dst.view[: piece.length])
                job.flushed_bytes += sum(s.length for s in piece.segments)
            except BaseException as exc:
                failures.append(exc)
                all_copied.set()  # the pieces holding their chunks for the replica let go of them
                raise
            finally:
                if chunk is not None:
                    self.pool.release(chunk)

        try:
            await self.flush(sink.create)
        except DatastatesError as exc:
            job.mark_failed(exc)
            return
        try:
            if job.replica is not None and job.replica.spare and not any(r.fenced for r in job.regions):
                # only over a spare's pages: fresh ones would be allocated before the copy, where the trainer
                # may wait on them, not on a flush thread after it; and GPU copies want pinned chunks
                pages = await self.flush(sink.in_place, plan.file_size)
                if pages is not None:
                    job.replica.in_place = True
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # "non-writable buffer": it is writable
                        in_place = torch.frombuffer(pages, dtype=torch.uint8)
            if job.fences is not None and any(r.fenced for r in job.regions):
                await job.fences.wait(job.stop_reason, self._fence)
            if not plan.pieces:
                job.mark_copied()
            deferred = self._defer_replica(job)
            try:
                await asyncio.gather(*(one(p) for p in plan.pieces), return_exceptions=True)
            finally:
                self._deferring -= len(plan.pieces) if deferred else 0
            in_place = pages = None  # every copy and write is done: finalize may unmap the pages
            for exc in failures:  # their tracebacks hold the copies' frames, whose locals still view the pages
                traceback.clear_frames(exc.__traceback__)
            if failures:
                raise failures[0]
            await self.write(_write_head, sink, plan, sums)
            if after:
                await asyncio.wait(after)
            await self.write(_finalize, job, sink)
        except Exception as exc:
            if not isinstance(exc, DatastatesError):
                log.exception("snapshot %d to %s failed", job.id, job.path)
                exc = SnapshotFailedError(f"snapshot of {job.path} failed: {exc}", path=job.path)
            try:
                await self.flush(sink.abort)
            finally:  # the job ends failed whatever its clean-up meets: a commit waiting on it must not hang
                job.mark_failed(exc)
            return
        if not sink.replicas_written:
            job.replica = None
        job.mark_durable()
        log.info("snapshot %d durable: %s (%d bytes)", job.id, job.path, job.total_bytes)

    def _defer_replica(self, job: SnapshotJob) -> bool:
        """Whether ``job``'s replica is written only once every piece is copied (each piece's chunk held until
        then), so its fresh pages are allocated after the copies, not while the trainer may wait on them: a rank
        file's first replica, which has no spare to be written over (the fence of a fresh daemon's first 1 GiB
        snapshot took 0.26 s with it, 0.15 s without). Only while the pieces of the snapshots deferring take half the
        pool's chunks at most: every other copy gives its chunk back once written, so each deferring snapshot gets
        a chunk for each of its pieces in time, no copy waits on a chunk that waits on it, and the ranks that came
        later find chunks (eight ranks' first snapshots, deferred up to the whole pool, left the last one waiting
        for seven others' whole copies)."""
        pieces = len(job.plan.pieces) if job.plan is not None else 0
        if job.replica is None or job.replica.spare or self._deferring + pieces > self.pool.capacity // 2:
            return False
        self._deferring += pieces
        return True

    def close(self) -> None:
        self._prefill.shutdown(wait=True, cancel_futures=True)
        self._fence.shutdown(wait=True)
        self._copy.shutdown(wait=True)
        self._flush.shutdown(wait=True)
        self._files.shutdown(wait=True)


def _write_head(sink: FileSink, plan: FilePlan, sums: list[list[bytes]]) -> None:
    """The head, now with every checksum, and the zip's central directory: encoded here, off the event loop (a
    header of 100,000 tensors takes 0.3 s)."""
    sink.header(plan.head(sums), plan.data_offset, plan.layout.tail_at, plan.layout.tail)


def _finalize(job: SnapshotJob, sink: FileSink) -> None:
    """Rename the file into place, on a flush thread right after the last check that its trainer still wants it."""
    job.check_still_wanted()
    sink.finalize()
