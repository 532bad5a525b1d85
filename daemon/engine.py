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
from typing import Any, Callable, cast

import torch

from datastates.protocol.errors import DatastatesError, SnapshotFailedError
from datastates.protocol.storage import Gone, Storage, WritableStorage, backend_class

from .copier import copy_piece, write_hashed
from .instances import daemons_folder
from .snapshot import AdmittedSnapshot
from .memory import Chunk, HostPool, Window
from datastates.protocol.layout import FilePlan, Piece

from .replica.backend import MemoryStorage
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
        self._writers: dict[type, Storage] = {}
        self.replica_storage = MemoryStorage(direct_io=direct_io, owner=owner)
        """The backend of the snapshots' in-memory replicas."""

    def writer(self, path: str) -> WritableStorage:
        """The one backend instance for ``path``'s scheme, made with the config's options (a snapshot's path is
        always a file system's, which takes pieces from memory)."""
        return cast(WritableStorage, self.storage(path))

    def storage(self, path: str) -> Storage:
        """The one backend instance for ``path``'s scheme (an object store tier's too, for its leftovers)."""
        cls = backend_class(path)
        if cls not in self._writers:
            self._writers[cls] = cls(direct_io=self._direct_io, owner=self._owner, journals=daemons_folder())
        return self._writers[cls]

    async def remove_leftovers(self, roots: list[str], gone: Gone) -> tuple[list[str], set[str]]:
        """What killed daemons of this node (``gone`` owners) left half-written under the roots, deleted; and the
        owners whose leftovers could not all be (``Storage.kept``)."""
        removed: list[str] = []
        for root in roots:
            removed += await self.flush(self.storage(root).remove_leftovers, root, gone)
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

    async def run(self, job: AdmittedSnapshot, after: list[asyncio.Future]) -> None:
        """Carry ``job`` to durable or failed; never raises.

        ``after`` are earlier snapshots of the same path: this one is renamed into place
        only once they are done, so the newest snapshot of a path is the one that stays.
        """
        plan = job.plan
        assert plan is not None
        replicas = [] if job.replica is None else [(self.replica_storage, job.replica.file, job.replica.spare)]
        run = _Run(self, job, FileSink(self.writer(plan.path), plan.path, f"{job.client_id}-{job.id}", replicas))
        try:
            await self.flush(run.sink.create)
        except DatastatesError as exc:
            job.mark_failed(exc)
            return
        try:
            await run.fill_replica()
            if job.fences is not None and any(r.fenced for r in job.regions):
                await job.fences.wait(job.stop_reason, self._fence)
            if not plan.pieces:
                job.mark_copied()
            run.deferred = self._defer_replica(job)
            try:
                await asyncio.gather(*(run.piece(p) for p in plan.pieces), return_exceptions=True)
            finally:
                self._deferring -= len(plan.pieces) if run.deferred else 0
            run.let_go_of_pages()
            await self.write(_write_head, run.sink, plan, run.sums)
            if after:
                await asyncio.wait(after)
            await self.write(_finalize, job, run.sink)
        except Exception as exc:
            if not isinstance(exc, DatastatesError):
                log.exception("snapshot %d to %s failed", job.id, job.path)
                exc = SnapshotFailedError(f"snapshot of {job.path} failed: {exc}", path=job.path)
            try:
                await self.flush(run.sink.abort)
            finally:  # the job ends failed whatever its clean-up meets: a commit waiting on it must not hang
                job.mark_failed(exc)
            return
        if not run.sink.replicas_written:
            job.replica = None
        job.mark_durable()
        log.info("snapshot %d durable: %s (%d bytes)", job.id, job.path, job.total_bytes)

    async def copy(self, piece: Piece, dst: Chunk | Window, job: AdmittedSnapshot) -> None:
        """Copy ``piece`` of ``job`` into ``dst`` on a copy thread, in this client's turn."""
        async with self._copy_turns.turn(job.client_id):
            await asyncio.get_running_loop().run_in_executor(self._copy, copy_piece, piece, dst, job.regions,
                                                             job.before_copy, job.add_copied)

    def _defer_replica(self, job: AdmittedSnapshot) -> bool:
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


class _Run:
    """One snapshot's way through the pipeline: each piece acquires a chunk, is copied, written, and releases it."""

    def __init__(self, engine: Engine, job: AdmittedSnapshot, sink: FileSink) -> None:
        assert job.plan is not None
        self.engine = engine
        self.job = job
        self.plan = job.plan
        self.sink = sink
        self.sums: list[list[bytes]] = [list(s.checksums) for s in self.plan.header.storages]
        self.failures: list[BaseException] = []
        self.uncopied = len(self.plan.pieces)
        self.all_copied = asyncio.Event()
        self.pages: memoryview | None = None
        self.replica_tensor: torch.Tensor | None = None
        """The replica's own pages, which the copies fill directly (``fill_replica``), or None."""
        self.deferred = False
        """Whether the replica is written only once every piece is copied (``Engine._defer_replica``)."""

    async def fill_replica(self) -> None:
        """Have the copies fill the replica's pages, from which the file is written, where its backend says so."""
        replica = self.job.replica
        fenced = any(r.fenced for r in self.job.regions)
        if replica is None or not self.engine.replica_storage.fills_directly(replica.spare, fenced):
            return
        self.pages = await self.engine.flush(self.sink.replica_pages, self.plan.file_size)
        if self.pages is not None:
            replica.in_place = True
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "non-writable buffer": it is writable
                self.replica_tensor = torch.frombuffer(self.pages, dtype=torch.uint8)

    async def piece(self, piece: Piece) -> None:
        """Acquire a chunk, copy ``piece`` into it (or into the replica's pages), write it, release the chunk."""
        engine, job = self.engine, self.job
        if self.failures:
            return
        chunk: Chunk | None = await engine.pool.acquire(job.client_id)
        at = self.plan.data_offset + piece.offset
        try:
            if self.failures:
                return
            if job.abandoned is not None:
                raise job.abandoned
            into_replica = self.replica_tensor is not None
            dst = Window(self.replica_tensor, self.pages, at, piece.length) if into_replica else chunk
            await engine.copy(piece, dst, job)
            self.uncopied -= 1
            if self.uncopied == 0:
                job.mark_copied()
                self.all_copied.set()
            if into_replica:
                engine.pool.release(chunk)  # it only paced this copy: the bytes are in the replica's pages
                chunk = None
            else:
                engine.pool.copied(chunk)
            await engine.write(write_hashed, self.sink, piece, dst, at, into_replica, self.sums, not self.deferred)
            if self.deferred:
                await self.all_copied.wait()
                if self.failures:
                    return
                await engine.write(self.sink.write_replicas, at, dst.view[: piece.length])
            job.flushed_bytes += sum(s.length for s in piece.segments)
        except BaseException as exc:
            self.failures.append(exc)
            self.all_copied.set()  # the pieces holding their chunks for the replica let go of them
            raise
        finally:
            if chunk is not None:
                engine.pool.release(chunk)

    def let_go_of_pages(self) -> None:
        """Every copy and write is done: drop this run's views of the replica's pages, so finalize may unmap them;
        then raise the first failure."""
        self.replica_tensor = self.pages = None
        for exc in self.failures:  # their tracebacks hold the copies' frames, whose locals still view the pages
            traceback.clear_frames(exc.__traceback__)
        if self.failures:
            raise self.failures[0]


def _write_head(sink: FileSink, plan: FilePlan, sums: list[list[bytes]]) -> None:
    """The head, now with every checksum, and the zip's central directory: encoded here, off the event loop (a
    header of 100,000 tensors takes 0.3 s)."""
    sink.header(plan.head(sums), plan.data_offset, plan.layout.tail_at, plan.layout.tail)


def _finalize(job: AdmittedSnapshot, sink: FileSink) -> None:
    """Rename the file into place, on a flush thread right after the last check that its trainer still wants it."""
    job.check_still_wanted()
    sink.finalize()
