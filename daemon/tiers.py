"""Storage tiers: a tag committed on a fast tier is copied down the slower ones in the background.

A snapshot lands on the tier its path lies in (the first, in the usual set-up: local NVMe
or /dev/shm), and COMMIT answers as soon as the tag is committed there. The daemon then
copies the node's files of the tag to each later tier, one tag at a time in commit
order, piece by piece on the flush threads (so snapshot writes interleave), and commits
the tag on each tier with a marker of its own, by the same rules as the first: fsynced
files, then the marker, then the trackers, then that tier's ``keep_last``. A tier copy
that fails leaves the tag uncommitted on that tier only; the faster copy stands.

When the slow tier falls behind, a queued copy that a newer tag of the same folder
overtakes is skipped as ``superseded``, so the backlog stays at one tag and the fast
tier's retention is not held up. In a multi-node job every tag is copied, in order, as
node 0 gathers every node's done marker on each shared tier.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import logging
import mmap
import os
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from datastates.protocol import messages as m
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import DatastatesError, StorageError
from datastates.protocol.format import CommitMarker, marker_name, read_marker

from .config import StorageConfig
from .engine import Engine
from .paths import shallow_walk
from .storage.posix import open_for_reading

log = logging.getLogger(__name__)

HISTORY = 64
SCAN_DEPTH = 4
"""How deep below a tier's root a restart looks for tag folders (<tier>/<run>/<tag>/ is depth 2)."""
COPY_PIECE = 16 << 20
"""Bytes read and written per flush-thread call: small enough that snapshot pieces interleave."""

Settle = Callable[[str, str, dict[str, int], Ranks, int, int], Awaitable[m.Committed]]
"""The ledger's commit of (client, tag, files, ranks, requested_ns, order) on the storage the files are on."""


class TierState:
    QUEUED = "queued"
    COPYING = "copying"
    COMMITTED = "committed"
    FAILED = "failed"
    SUPERSEDED = "superseded"
    PRUNED = "pruned"


@dataclass
class TierCopy:
    """One tag on one tier: where it stands, and how far its copy has come."""

    tier: str
    folder: str
    state: str = TierState.QUEUED
    bytes_done: int = 0
    bytes_total: int = 0
    error: str = ""


@dataclass
class TagCopies:
    """A tag committed on tier ``source``, and its copies to each later tier."""

    client_id: str
    tag: str
    files: dict[str, int]
    """This node's files of the tag on the source tier (path → size)."""
    ranks: Ranks
    requested_ns: int
    order: int
    source: int
    copies: list[TierCopy] = field(default_factory=list)
    """One per tier from the source on: the source's is committed from the start."""

    @property
    def series(self) -> str:
        """The folder holding the tag's folder: tags of one run, one after another."""
        return os.path.dirname(os.path.dirname(next(iter(self.files))))


def _copy_range(src_fd: int, writer: Any, handle: Any, buf: mmap.mmap, offset: int, length: int) -> None:
    """``length`` bytes at ``offset`` from the source file to the new copy, through one aligned buffer."""
    view = memoryview(buf)[:length]
    done = 0
    while done < length:
        n = os.preadv(src_fd, [view[done:]], offset + done)
        if n == 0:
            raise StorageError(f"the source file ended at byte {offset + done}, before its committed size", errno=errno.EIO)
        done += n
    writer.write(handle, offset, view)


def _newest_per_series(root: str) -> list[tuple[str, CommitMarker]]:
    """(tag folder, marker) of the newest committed tag in each folder of tags under ``root``."""
    newest: dict[str, tuple[str, CommitMarker]] = {}
    for folder, _, files in shallow_walk(root, SCAN_DEPTH):
        name = marker_name(os.path.basename(folder))
        marker = read_marker(os.path.join(folder, name)) if name in files else None
        if marker is None:
            continue
        series = os.path.dirname(folder)
        if series not in newest or marker.newness > newest[series][1].newness:
            newest[series] = (folder, marker)
    return sorted(newest.values())


class TierCopier:
    def __init__(self, engine: Engine, storage: StorageConfig, settle: Settle) -> None:
        self._engine = engine
        self._storage = storage
        self.tiers = storage.tiers
        self._settle = settle
        self._queue: collections.deque[TagCopies] = collections.deque()
        """Tags whose copies are not over: the head is being copied, the rest wait."""
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._scanning = len(self.tiers) > 1
        """Until ``resume`` has looked, copies a killed run left may be owed: ``datastatesctl wait`` must not return."""
        self.history: collections.deque[TagCopies] = collections.deque(maxlen=HISTORY)

    def shared(self, path: str) -> bool:
        """Whether every node sees ``path``: a tier not marked otherwise, or a plain root."""
        tier = self._storage.tier_of(path)
        return tier is None or self.tiers[tier].shared

    def schedule(self, client_id: str, tag: str, files: dict[str, int], ranks: Ranks, requested_ns: int,
                 order: int) -> None:
        """Queue the copies of a tag just committed on its tier to every later tier."""
        source = self._storage.tier_of(next(iter(files))) if files else None
        if source is None or source == len(self.tiers) - 1:
            return
        home, size = self.tiers[source], sum(files.values())
        folder = os.path.dirname(next(iter(files)))
        entry = TagCopies(client_id, tag, files, ranks, requested_ns, order, source,
                          [TierCopy(t.name, t.place(folder, home), bytes_total=size) for t in self.tiers[source:]])
        entry.copies[0].state, entry.copies[0].bytes_done = TierState.COMMITTED, size
        if ranks.num_nodes == 1:
            for older in [q for q in self._queue if q.series == entry.series and q.source == source
                          and all(c.state == TierState.QUEUED for c in q.copies[1:])]:
                for copy in older.copies[1:]:
                    copy.state, copy.error = TierState.SUPERSEDED, f"tag {tag!r} was committed before this copy began"
                self._queue.remove(older)
                log.info("tier copy of %s skipped: %s is newer", older.tag, tag)
        self._queue.append(entry)
        self.history.append(entry)
        self._wake.set()
        if self._worker is None:
            self._worker = asyncio.ensure_future(self._run())

    async def resume(self) -> list[str]:
        """At start: queue again the copies a stopped or killed daemon left undone; the markers of the tags queued.

        Per folder of tags, the newest committed on a tier is copied down if the next tier
        lacks it committed (older ones stay as they are: a later tag supersedes them). A
        multi-node tag resumes from a node-local tier only, where the marker names its node.
        """
        try:
            undone = await self._engine.flush(self._undone)
        except OSError as exc:
            log.warning("cannot look for tier copies an earlier run left undone: %s", exc)
            undone = []
        finally:
            self._scanning = False
        for folder, marker in undone:
            ranks = Ranks() if marker.nodes == 1 else Ranks(
                rank=max(0, marker.node), world_size=marker.nodes, num_nodes=marker.nodes, node_rank=max(0, marker.node))
            files = {os.path.join(folder, f.path): f.size for f in marker.files}
            self.schedule("resumed", marker.tag, files, ranks, marker.requested_ns, 0)
        return [os.path.join(folder, marker_name(marker.tag)) for folder, marker in undone]

    def _undone(self) -> list[tuple[str, CommitMarker]]:
        out = []
        for source, tier in enumerate(self.tiers[:-1]):
            nxt = self.tiers[source + 1]
            for folder, marker in _newest_per_series(tier.path):
                if marker.nodes > 1 and marker.node < 0:
                    continue  # every node's files on a shared tier: which node copies what is not known at start
                if read_marker(os.path.join(nxt.place(folder, tier), marker_name(marker.tag))) is None:
                    out.append((folder, marker))
        return out

    def pending_tags(self) -> set[str]:
        """Tags still to be copied off their tier: that tier's retention must spare them."""
        return {e.tag for e in self._queue}

    def pending(self) -> int:
        return len(self._queue) + self._scanning

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            entry = self._queue[0]
            try:
                await self._copy_down(entry)
            except Exception:  # the worker must outlive any one tag
                log.exception("tier copy of %s failed", entry.tag)
            finally:
                if self._queue and self._queue[0] is entry:
                    self._queue.popleft()
                for copy in entry.copies:
                    if copy.state in (TierState.QUEUED, TierState.COPYING):
                        copy.state, copy.error = TierState.FAILED, copy.error or "the copy to an earlier tier failed"

    async def _copy_down(self, entry: TagCopies) -> None:
        home = self.tiers[entry.source]
        for i, copy in enumerate(entry.copies[1:]):
            tier = self.tiers[entry.source + 1 + i]
            dest = {tier.place(p, home): n for p, n in entry.files.items()}
            copy.state = TierState.COPYING
            try:
                for (src, size), path in zip(entry.files.items(), dest):
                    await self._copy_file(src, path, size, copy, f"tier-{entry.order}")
                await self._settle(entry.client_id, entry.tag, dest, entry.ranks, entry.requested_ns, entry.order)
            except (DatastatesError, OSError) as exc:
                copy.state = TierState.FAILED
                copy.error = getattr(exc, "message", None) or str(exc)
                log.warning("tag %s not committed on tier %s: %s", entry.tag, tier.name, copy.error)
                return
            copy.state = TierState.COMMITTED
            log.info("tag %s committed on tier %s", entry.tag, tier.name)

    async def _copy_file(self, src: str, dest: str, size: int, copy: TierCopy, token: str) -> None:
        writer = self._engine.writer(dest)
        src_fd = await self._engine.flush(open_for_reading, src)
        try:
            if os.fstat(src_fd).st_size != size:
                raise StorageError(f"cannot copy {src}: it is {os.fstat(src_fd).st_size} bytes, its marker says {size}",
                                   path=src)
            handle = await self._engine.flush(writer.create, dest, token)
            buf = mmap.mmap(-1, COPY_PIECE)
            try:
                for offset in range(0, size, COPY_PIECE):
                    length = min(COPY_PIECE, size - offset)
                    await self._engine.flush(_copy_range, src_fd, writer, handle, buf, offset, length)
                    copy.bytes_done += length
                await self._engine.flush(writer.finalize, handle)
            except BaseException:
                await self._engine.flush(writer.abort, handle)
                raise
            finally:
                buf.close()
        finally:
            os.close(src_fd)

    def pruned(self, folders: list[str]) -> None:
        """Retention deleted these tag folders: their tier no longer holds the tag."""
        gone = set(folders)
        for entry in self.history:
            for copy in entry.copies:
                if copy.folder in gone and copy.state == TierState.COMMITTED:
                    copy.state = TierState.PRUNED

    def status(self) -> dict[str, Any]:
        return {
            "tiers": [dataclasses.asdict(t) for t in self.tiers],
            "pending": self.pending(),
            "tags": [{"tag": e.tag, "series": e.series, "tiers": [dataclasses.asdict(c) for c in e.copies]}
                     for e in self.history],
        }

    def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
