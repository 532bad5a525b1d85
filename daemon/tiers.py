"""Storage tiers: a tag committed on a fast tier is transferred down the slower ones in the background.

A snapshot lands on the tier its path lies in (the first, in the usual set-up: local NVMe
or /dev/shm), and COMMIT answers as soon as the tag is committed there. The ledger then
announces the commit, and the daemon's ``TierTransfers`` transfers the node's files of
the tag to each later tier, one tag at a time in commit order, piece by piece on the flush
threads (so snapshot writes interleave), and has the ledger commit the tag on each tier
with a marker of its own, by the same rules as the first: fsynced files, then the marker,
then the trackers, then that tier's ``keep_last``. An object store tier (``s3://``) takes
the pieces as the parts of one multipart upload per file, several at once, uploaded by the
upload process (daemon/uploader.py), and ``ObjectTiers`` (daemon/objecttiers.py) commits the
tag there instead of the ledger. A transfer that fails leaves the tag uncommitted on that tier only; the faster
tier's commit stands. A transfer opens the tag's files once, before any byte moves, each checked to hold the
snapshot its commit lists, and reads only through those descriptors: a version switched in meanwhile (the tag
saved again) never mixes into what a lower tier commits, nor does a file replaced before the transfer began.

When the slow tier falls behind, a queued transfer that a newer tag of the same run
overtakes is skipped as ``superseded``, so the backlog stays at one tag and the fast
tier's retention is not held up. In a multi-node job every tag is transferred, in order, as
node 0 gathers every node's done marker on each shared tier.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any

from datastates.protocol.descriptors import Ranks, Tier
from datastates.protocol.errors import DatastatesError, StorageError
from datastates.protocol.fileio import open_for_reading, read_range
from datastates.protocol.format import marker_name
from datastates.protocol.tags import CommittedTag, committed_tags, read_marker, snapshot_in

from .commit import CommitLedger
from .events import CommitEvent
from .config import HISTORY, StorageConfig
from .engine import Engine
from .objecttiers import ObjectTiers
from .uploader import PARTS_AT_ONCE
from .sink import FileSink

log = logging.getLogger(__name__)

SCAN_DEPTH = 4
"""How deep below a tier's root a restart looks for tag folders (<tier>/<run>/<tag>/ is depth 2)."""
TRANSFER_PIECE = 16 << 20
"""Bytes read and written per flush-thread call: small enough that snapshot pieces interleave."""
TRANSFER_STALL_S = 20.0
"""A drain waits for the tier transfers while they move: once none has moved a piece (TRANSFER_PIECE, or an
uploaded PART), begun or ended for this long (a hung tier), it stops waiting, and the daemon exits; the next daemon
of the node aborts the uploads left open (their journal) and transfers the tag again (``resume``)."""


class TransferState:
    QUEUED = "queued"
    TRANSFERRING = "transferring"
    COMMITTED = "committed"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    PRUNED = "pruned"


@dataclass
class TierTransfer:
    """One tag on one tier: where it stands, and how far its transfer has come."""

    tier: str
    folder: str
    state: str = TransferState.QUEUED
    bytes_done: int = 0
    bytes_total: int = 0
    error: str = ""


@dataclass
class TagTransfers:
    """A tag committed on tier ``source``, and its transfers to each later tier."""

    commit: CommitEvent
    source: int
    tiers: list[TierTransfer] = field(default_factory=list)
    """One per tier from the source on: the source's is committed from the start."""

    @property
    def run(self) -> str:
        """The folder holding the tag's folder: one run's tags, one after another."""
        return os.path.dirname(os.path.dirname(next(iter(self.commit.files))))


def _transfer_range(src_fd: int, sink: FileSink, buf: mmap.mmap, offset: int, length: int) -> None:
    """``length`` bytes at ``offset`` from the source file into the sink, through one aligned buffer."""
    sink.write(offset, read_range(src_fd, buf, offset, length))


def _pin(commit: CommitEvent) -> dict[str, int]:
    """Each file of ``commit`` opened: the version the transfer carries to every lower tier, whatever is switched in at
    its path meanwhile (a newer version of the tag). Each must be the size and the snapshot the commit lists, else
    StorageError: the tag was saved again, or the file replaced, before the transfer began."""
    opened: dict[str, int] = {}
    try:
        for src, size in commit.files.items():
            fd = opened[src] = open_for_reading(src)
            held = os.fstat(fd).st_size
            if held != size:
                raise StorageError(f"cannot transfer {src}: it is {held} bytes, its marker says {size}", path=src)
            want = commit.snapshots.get(src, "")
            if want and (got := _snapshot_of(fd, src)) != want:
                raise StorageError(f"cannot transfer {src}: it holds snapshot {got or '(none: it is no checkpoint)'}, "
                                   f"not {want}, which tag {commit.tag!r} committed: the tag was saved again, or the "
                                   "file replaced, since", path=src)
        return opened
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise


def _snapshot_of(fd: int, name: str) -> str:
    """``snapshot_in`` of the file open at ``fd``, through a descriptor of its own without O_DIRECT (the header's
    reads are small and unaligned)."""
    plain = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return snapshot_in(plain, name)
    finally:
        os.close(plain)


def _newness(entry: TagTransfers) -> tuple[int, int]:
    """Which of two tags of a run is newer (``CommitMarker.newness``, less the clock of the commit's end)."""
    return entry.commit.sequence, entry.commit.requested_ns


def _newest_per_run(root: str) -> list[CommittedTag]:
    """The newest committed tag of each run (folder of tag folders) under ``root``."""
    newest: dict[str, CommittedTag] = {}
    for tag in committed_tags(root, SCAN_DEPTH, own_folder=True):  # newest first
        newest.setdefault(tag.run, tag)
    return sorted(newest.values(), key=lambda t: t.folder)


class TierTransfers:
    """The ledger's listener that carries each committed tag down the tiers; owned by the daemon."""

    def __init__(self, engine: Engine, storage: StorageConfig, ledger: CommitLedger, owner: str,
                 commit_timeout: float) -> None:
        self._engine = engine
        self._storage = storage
        self.tiers = storage.tiers
        self._ledger = ledger
        self.objects = ObjectTiers(self.tiers, owner, commit_timeout, storage.upload_priority == "idle")
        self._queue: collections.deque[TagTransfers] = collections.deque()
        """Tags whose transfers are not over: the head is being transferred, the rest wait."""
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._scanning = len(self.tiers) > 1
        """Until ``resume`` has looked, transfers a killed run left may be owed: ``datastatesctl wait`` must not return."""
        self.history: collections.deque[TagTransfers] = collections.deque(maxlen=HISTORY)
        self._moved = time.monotonic()
        """When a transfer last moved (``drained``)."""
        ledger.subscribe(self)

    # -- the ledger's announcements -----------------------------------------------------

    def committed(self, commit: CommitEvent) -> None:
        """A tag was just committed on its tier: queue its transfers to every later tier."""
        source = self._storage.tier_of(next(iter(commit.files))) if commit.files else None
        if source is None or source == len(self.tiers) - 1:
            return
        home, size = self.tiers[source], sum(commit.files.values())
        folder = os.path.dirname(next(iter(commit.files)))
        entry = TagTransfers(commit, source,
                             [TierTransfer(t.name, t.place(folder, home), bytes_total=size) for t in self.tiers[source:]])
        entry.tiers[0].state, entry.tiers[0].bytes_done = TransferState.COMMITTED, size
        if commit.ranks.num_nodes == 1:
            for older in [q for q in self._queue if q.run == entry.run and q.source == source
                          and all(t.state == TransferState.QUEUED for t in q.tiers[1:]) and _newness(q) < _newness(entry)]:
                for t in older.tiers[1:]:
                    t.state, t.error = TransferState.SUPERSEDED, f"tag {commit.tag!r} was committed before this transfer began"
                self._queue.remove(older)
                log.info("tier transfer of %s skipped: %s is newer", older.commit.tag, commit.tag)
        self._queue.append(entry)
        self.history.append(entry)
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.ensure_future(self._run())

    def pruned(self, folders: list[str]) -> None:
        """Retention deleted these tag folders: their tier no longer holds the tag."""
        gone = set(folders)
        for entry in self.history:
            for t in entry.tiers:
                if t.folder in gone and t.state == TransferState.COMMITTED:
                    t.state = TransferState.PRUNED

    def holds(self) -> set[str]:
        """Tags still to be transferred off their tier: that tier's retention must spare them."""
        return {e.commit.tag for e in self._queue}

    # -- start-up -------------------------------------------------------------------------

    async def resume(self) -> list[str]:
        """At start: queue again the transfers a stopped or killed daemon left undone; the markers of the tags queued.

        Per run, the newest tag committed on a tier is transferred down if the next tier
        lacks it committed (older ones stay as they are: a later tag supersedes them). A
        multi-node tag resumes from a node-local tier only, where the marker names its node.
        """
        try:
            if self.objects.tiers:
                self.objects.start()
                await asyncio.wrap_future(self.objects.call(self.objects.check))
            undone = await self._engine.flush(self._undone)
        except (OSError, DatastatesError) as exc:
            log.warning("cannot look for tier transfers an earlier run left undone: %s", exc)
            undone = []
        finally:
            self._scanning = False
            self._progress()
        for found in undone:
            marker = found.marker
            if any(e.run == found.run and _newness(e) >= (marker.sequence, marker.requested_ns) for e in self.history):
                continue  # this daemon's own commits since it started announced it, or a newer tag of its run
            ranks = Ranks() if marker.nodes == 1 else Ranks(
                rank=max(0, marker.node), world_size=marker.nodes, num_nodes=marker.nodes, node_rank=max(0, marker.node),
                job=marker.job)
            files = {os.path.join(found.folder, f.path): f.size for f in marker.files}
            snapshots = {os.path.join(found.folder, f.path): f.snapshot for f in marker.files}
            self.committed(CommitEvent("resumed", marker.tag, files, ranks, marker.requested_ns, 0, marker.sequence,
                                       snapshots))
        return [found.marker_path for found in undone]

    def _undone(self) -> list[CommittedTag]:
        out = []
        for source, tier in enumerate(self.tiers[:-1]):
            nxt = self.tiers[source + 1]
            for found in _newest_per_run(tier.path):
                if found.marker.nodes > 1 and found.marker.node < 0:
                    continue  # every node's files on a shared tier: which node transfers what is not known at start
                if read_marker(os.path.join(nxt.place(found.folder, tier), marker_name(found.tag))) is None:
                    out.append(found)
        return out

    # -- the worker -----------------------------------------------------------------------

    def pending(self) -> int:
        return len(self._queue) + self._scanning

    def drained(self) -> bool:
        """Whether a drain may stop: no transfer pending, or none moved for TRANSFER_STALL_S (left for the next
        daemon)."""
        stalled = time.monotonic() - self._moved
        if not self.pending() or stalled < TRANSFER_STALL_S:
            return not self.pending()
        log.warning("leaving %d tier transfer(s) for the next daemon: none has moved for %.0f s (a hung tier?)",
                    self.pending(), stalled)
        return True

    def _progress(self) -> None:
        self._moved = time.monotonic()

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            entry = self._queue[0]
            try:
                await self._transfer_down(entry)
            except Exception:  # the worker must outlive any one tag
                log.exception("tier transfer of %s failed", entry.commit.tag)
            finally:
                self._progress()
                if self._queue and self._queue[0] is entry:
                    self._queue.popleft()
                for t in entry.tiers:
                    if t.state in (TransferState.QUEUED, TransferState.TRANSFERRING):
                        t.state, t.error = TransferState.FAILED, t.error or "the transfer to an earlier tier failed"

    async def _transfer_down(self, entry: TagTransfers) -> None:
        home, commit = self.tiers[entry.source], entry.commit
        entry.tiers[1].state = TransferState.TRANSFERRING  # from here on no newer commit supersedes it
        try:
            sources = await self._engine.flush(_pin, commit)
        except (DatastatesError, OSError) as exc:
            newer = any(q.run == entry.run and _newness(q) > _newness(entry) for q in self._queue)
            for t in entry.tiers[1:]:
                t.state = TransferState.SUPERSEDED if newer else TransferState.FAILED
                t.error = getattr(exc, "message", None) or str(exc)
            log.warning("tag %s not transferred down from tier %s: %s", commit.tag, home.name, entry.tiers[1].error)
            return
        try:
            for i, transfer in enumerate(entry.tiers[1:]):
                if not await self._transfer_to(home, self.tiers[entry.source + 1 + i], commit, sources, transfer):
                    return
        finally:
            for fd in sources.values():
                os.close(fd)

    async def _transfer_to(self, home: Tier, tier: Tier, commit: CommitEvent, sources: dict[str, int],
                           transfer: TierTransfer) -> bool:
        """The tag's files on ``home``, read through ``sources`` (``_pin``), to ``tier``, and its commit there; whether
        it committed."""
        lower = commit.moved(lambda p: tier.place(p, home))
        transfer.state = TransferState.TRANSFERRING
        self._progress()
        uploaded = tier in self.objects.tiers  # written by upload: its tag is committed by ObjectTiers
        try:
            if uploaded:
                await asyncio.wrap_future(self.objects.call(self.objects.begin, lower))
            for (src, size), path in zip(commit.files.items(), lower.files):
                if uploaded:
                    await self._upload_file(sources[src], src, path, size, transfer, f"tier-{commit.order}")
                else:
                    await self._copy_file(sources[src], path, size, transfer, f"tier-{commit.order}")
            if uploaded:
                gone = await asyncio.wrap_future(self.objects.call(
                    self.objects.commit, lower, tier, self._storage.keep_last_at(tier.path), self.holds()))
                self.pruned(gone)
            else:
                await self._ledger.settle(lower)
        except (DatastatesError, OSError) as exc:
            transfer.state = TransferState.FAILED
            transfer.error = getattr(exc, "message", None) or str(exc)
            log.warning("tag %s not committed on tier %s: %s", commit.tag, tier.name, transfer.error)
            return False
        transfer.state = TransferState.COMMITTED
        self._progress()
        log.info("tag %s committed on tier %s", commit.tag, tier.name)
        return True

    async def _copy_file(self, src_fd: int, dest: str, size: int, transfer: TierTransfer, token: str) -> None:
        sink = FileSink(self._engine.writer(dest), dest, token)
        buf = mmap.mmap(-1, TRANSFER_PIECE)
        try:
            await self._engine.flush(sink.create)
            try:
                for offset in range(0, size, TRANSFER_PIECE):
                    length = min(TRANSFER_PIECE, size - offset)
                    await self._engine.write(_transfer_range, src_fd, sink, buf, offset, length)
                    transfer.bytes_done += length
                    self._progress()
                await self._engine.write(sink.finalize)
            except BaseException:
                await self._engine.flush(sink.abort)
                raise
        finally:
            with contextlib.suppress(BufferError):  # a failed piece's traceback still holds a view: freed with it
                buf.close()

    async def _upload_file(self, src_fd: int, src: str, dest: str, size: int, transfer: TierTransfer,
                           token: str) -> None:
        writer = self.objects.writer
        if size > writer.max_parts * writer.part:
            raise StorageError(f"cannot upload {src}: {size} bytes is more than {writer.max_parts} parts of "
                               f"{writer.part} bytes, the most an object store takes", path=dest)
        handle = await asyncio.wrap_future(self.objects.call(writer.create, dest, token))

        async def part(offset: int) -> None:
            length = min(writer.part, size - offset)
            await asyncio.wrap_future(writer.upload(handle, src_fd, offset, length))
            transfer.bytes_done += length
            self._progress()

        pending: set[asyncio.Future] = set()
        try:
            for offset in range(0, size, writer.part):
                if len(pending) >= PARTS_AT_ONCE:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for d in done:
                        d.result()
                pending.add(asyncio.ensure_future(part(offset)))
            for d in await asyncio.gather(*pending, return_exceptions=True):
                if isinstance(d, BaseException):
                    raise d
            pending = set()
            await asyncio.wrap_future(self.objects.call(writer.finalize, handle))
        except BaseException:
            await asyncio.gather(*pending, return_exceptions=True)  # no part still uploads when it is aborted
            await asyncio.wrap_future(self.objects.call(writer.abort, handle))
            raise

    def status(self) -> dict[str, Any]:
        return {
            "tiers": [dataclasses.asdict(t) for t in self.tiers],
            "problems": dict(self.objects.problems),
            "checked": self.objects.checked,
            "uploader": {"pid": self.objects.uploader.pid, "started": self.objects.uploader.started},
            "pending": self.pending(),
            "tags": [{"tag": e.commit.tag, "run": e.run, "tiers": [dataclasses.asdict(t) for t in e.tiers]}
                     for e in self.history],
        }

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
        self.objects.close()
