"""The trainer-side fallback: the daemon's write path, run in the trainer's own process when no daemon answers.

It blocks the trainer for the whole copy and write, which the daemon exists to avoid, so
it is off unless ``Client(fallback="local")`` asks for it; the client imports this module
only then, and it is the one client module that imports the daemon (bench/layering.py). It runs the daemon's own plan, copy and sink steps one piece at a time through
one buffer, so its files and markers are the same format, loaded by ``datastates.load``
and found by ``datastates.latest``. It keeps the daemon's promises too: a committed tag
saved again gets a new version switched in whole (daemon/resave.py, I2), and it tags
its temporary files and staging folders with an owner of its own (daemon/instances.py),
so the next daemon removes what a killed trainer left (I5).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Sequence

import torch

from datastates.protocol import messages as m
from datastates.protocol.descriptors import CUDA_IPC, VM
from datastates.protocol.errors import CommitError, DatastatesError
from datastates.protocol.format import marker_name
from datastates.protocol.layout import plan_snapshot
from datastates.protocol.storage import WritableStorage, backend_class
from datastates.protocol.tags import next_sequence

from datastates.daemon.commit import check_listed, make_marker, tag_folder
from datastates.daemon.copier import copy_piece, write_hashed
from datastates.daemon.instances import Instance
from datastates.daemon.memory import Chunk
from datastates.daemon.sink import FileSink
from datastates.daemon.sources import Owner, Region, open_region
from datastates.daemon.trackers import trackers
from datastates.daemon.resave import Versions

log = logging.getLogger(__name__)

_SELF = Owner(pid=os.getpid(), started=None, readable="a local save reads its own storages directly")
"""This process, as the owner of the shared-memory sources a local save maps."""

PIECE = 16 << 20
"""Small enough to keep the trainer's extra memory low, large enough for sequential writes."""


class _StorageRegion(Region):
    """A storage of this very process, read directly: a process cannot open its own CUDA IPC handles."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.nbytes = storage.nbytes()
        self.tensor = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (self.nbytes,), (1,))


class LocalSaver:
    def __init__(self) -> None:
        self._chunk: Chunk | None = None
        self._files: dict[str, dict[str, int]] = {}
        """Per tag, the files saved since its last commit, with their sizes."""
        self._snapshots: dict[str, str] = {}
        """Path → the snapshot its file holds, for the marker."""
        self._ids = itertools.count(1)
        self._instance = Instance()
        self._versions = Versions(self._instance.owner)

    def save(self, msg: m.Snapshot, storages: Sequence[torch.UntypedStorage | None]) -> m.SnapshotAck:
        """Write ``msg``'s file now: the same layout and checksums as the daemon writes.

        ``storages`` are the capture's: a process cannot open its own CUDA IPC handles, so
        GPU storages and CPU ones described by address are read directly (a synchronous copy,
        as torch.save makes).
        """
        msg = dataclasses.replace(msg, path=os.path.realpath(msg.path))  # the writer follows no link below /
        path = self._versions.place(msg.path, msg.tag, tag_folder(msg.tag, {msg.path: 0}, None))
        self._instance.record(os.path.dirname(os.path.dirname(path)))  # the run folder: its files and staging folders
        plan = plan_snapshot(msg, path, PIECE, f"{self._instance.owner}/local/{next(self._ids)}",
                             keep=False)  # its entries are captured anew each time, never met again
        regions = [_StorageRegion(st) if d.kind in (CUDA_IPC, VM) and st is not None else open_region(d, _SELF)
                   for d, st in zip(msg.sources, storages, strict=True)]
        if self._chunk is None:
            self._chunk = Chunk(PIECE)
        sink = FileSink(self._writer(path), path, "0")
        sums = [list(s.checksums) for s in plan.header.storages]
        try:
            sink.create()
            for piece in plan.pieces:
                copy_piece(piece, self._chunk, regions)
                write_hashed(sink, piece, self._chunk, plan.data_offset + piece.offset, False, sums)
            sink.header(plan.head(sums), plan.data_offset, plan.layout.tail_at, plan.layout.tail)
            sink.finalize()
        except BaseException:
            sink.abort()
            self._forget(msg.tag, [path])
            raise
        self._files.setdefault(msg.tag, {})[path] = plan.file_size
        self._snapshots[path] = plan.header.snapshot
        return m.SnapshotAck(snapshot_id=0, total_bytes=plan.total_bytes)

    def _forget(self, tag: str, paths: list[str]) -> None:
        """A save of ``tag`` failed: its version can never be whole, so its staging folder goes now.

        This trainer lives on, so no daemon would remove a staging folder of its owner (I5).
        """
        files = self._files.pop(tag, {})
        for p in files:
            self._snapshots.pop(p, None)
        self._versions.abandon([*files, *paths])

    def _writer(self, path: str) -> WritableStorage:
        return backend_class(path)(direct_io=False, owner=self._instance.owner)

    def commit(self, tag: str) -> m.Committed:
        files = self._files.pop(tag, None)
        if not files:
            raise CommitError(f"nothing to commit for tag {tag!r}: no snapshot with it was saved locally", tag=tag)
        snapshots = {p: self._snapshots.pop(p, "") for p in files}
        staging = self._versions.staged(tag, files)
        folder = tag_folder(tag, files, None) if staging is None else staging.staging
        run = os.path.dirname(folder if staging is None else staging.folder)
        marker = make_marker(tag, files, folder, time.time_ns(), next_sequence(run), snapshots=snapshots)
        path = os.path.join(folder, marker_name(tag))
        try:
            self._writer(path).publish(path, marker.encode(), check=functools.partial(check_listed, folder, marker, None))
            if staging is not None:
                self._versions.switch(staging)
        except BaseException:
            self._versions.abandon(list(files))  # the committed version stands; the new one is never committed
            raise
        self._track(tag, folder if staging is None else staging.folder)
        if staging is None:
            return m.Committed(tag=tag, marker=path, files=list(files))
        return m.Committed(tag=tag, marker=os.path.join(staging.folder, marker_name(tag)),
                           files=[staging.visible(p) for p in files])

    def _track(self, tag: str, folder: str) -> None:
        """The trackers beside a tag folder name the tag just committed, as the daemon's do (it is the newest: its
        sequence is past every marker of the run folder). Left unmoved, a tracker would name an older tag, one
        retention may keep for it, and DeepSpeed would resume from."""
        if os.path.basename(folder) == tag:
            for tracker, data in trackers(tag, folder).items():
                try:
                    self._writer(tracker).publish(tracker, data)
                except (OSError, DatastatesError) as exc:  # the tag is committed all the same: its marker is
                    log.warning("tag %s committed, but its tracker %s was not written: %s", tag, tracker, exc)
