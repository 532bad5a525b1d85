"""Commit: a tag becomes committed when all its files are durable and its marker is in place.

The marker lists every file of the tag with its size; it is written under a temporary
name, fsynced and renamed into the folder that holds the tag's files. Readers trust
nothing else (client/reader.py). Commits are per client for now: a tag's marker lists
the files that client snapshotted under it.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

from datastates.protocol import messages as m
from datastates.protocol.errors import CommitError, SnapshotSkippedError, StorageError
from datastates.protocol.format import CommitMarker, MarkerFile, marker_name
from datastates.protocol.version import COMMIT_VERSION

from .engine import Engine
from .job import SnapshotJob
from .paths import within

HISTORY = 64


def make_marker(tag: str, files: dict[str, int], roots: list[str] | None) -> tuple[str, CommitMarker]:
    """The marker listing ``files`` (path → size), and where it goes: their common folder, inside a root."""
    folder = os.path.commonpath([os.path.dirname(p) for p in files])
    if roots is not None and not any(within(folder, r) for r in roots):
        raise CommitError(f"tag {tag!r} spans folders with no common folder inside the roots", tag=tag)
    marker = CommitMarker(
        version=COMMIT_VERSION,
        tag=tag,
        committed_ns=time.time_ns(),
        files=[MarkerFile(path=os.path.relpath(p, folder), size=n) for p, n in files.items()],
    )
    return os.path.join(folder, marker_name(tag)), marker


class CommitLedger:
    def __init__(self, engine: Engine, roots: list[str]) -> None:
        self._engine = engine
        self._roots = roots
        self._open: dict[tuple[str, str], list[SnapshotJob]] = {}
        self._skipped: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self.committed: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.pending = 0

    def add(self, job: SnapshotJob) -> None:
        self._open.setdefault((job.client_id, job.tag), []).append(job)

    def skip(self, client_id: str, tag: str, reason: str) -> None:
        """Remember why ``tag`` was skipped, so its commit says so instead of 'nothing to commit'."""
        self._skipped[(client_id, tag)] = reason
        while len(self._skipped) > HISTORY:
            self._skipped.popitem(last=False)

    def skipped(self, client_id: str, tag: str) -> str:
        return self._skipped.get((client_id, tag), "")

    def forget(self, client_id: str) -> None:
        """A client that leaves without committing leaves no tag half-open behind."""
        for table in (self._open, self._skipped):
            for key in [k for k in table if k[0] == client_id]:
                del table[key]

    async def commit(self, client_id: str, tag: str) -> m.Committed:
        reason = self._skipped.pop((client_id, tag), "")
        if reason:
            raise SnapshotSkippedError(f"tag {tag!r} not committed: it was skipped ({reason})", tag=tag)
        jobs = self._open.pop((client_id, tag), None)
        if not jobs:
            raise CommitError(f"nothing to commit for tag {tag!r}: this client has no uncommitted snapshot with it", tag=tag)
        self.pending += 1
        try:
            results = await asyncio.gather(*(j.durable for j in jobs), return_exceptions=True)
            failed = [(j, r) for j, r in zip(jobs, results) if isinstance(r, BaseException)]
            if failed:
                job, exc = failed[0]
                raise CommitError(
                    f"tag {tag!r} not committed: {len(failed)} of its {len(jobs)} snapshot(s) failed; first: {job.path}: {exc}",
                    tag=tag,
                )
            files = {j.path: j.file_size for j in jobs}
            path, marker = make_marker(tag, files, self._roots)
            try:
                await self._engine.flush(self._engine.writer(path).publish, path, marker.encode())
            except StorageError as exc:
                self._open[(client_id, tag)] = jobs + self._open.get((client_id, tag), [])  # a retry may succeed
                raise CommitError(f"tag {tag!r} not committed: {exc.message}", tag=tag) from None
            self.committed.append({"tag": tag, "client": client_id, "marker": path, "files": len(files), "committed_ns": marker.committed_ns})
            return m.Committed(tag=tag, marker=path, files=list(files))
        finally:
            self.pending -= 1
