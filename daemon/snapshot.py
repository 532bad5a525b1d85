"""One snapshot's life in the daemon, and what ``status`` shows of it.

States, in order: copying (pieces going into the pool) → flushing (all bytes held by the
daemon, writes still running) → durable (fsynced and renamed) | failed. ``copied`` and
``durable`` are futures on the event loop that WAIT and COMMIT await.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from typing import Any, Callable, Sequence

from datastates.protocol import outcome
from datastates.protocol.errors import SnapshotFailedError

from datastates.protocol.layout import FilePlan

from .rate import RecentRate, average
from .replica.table import Replica
from .sources import Region
from .sources.cuda import Fences


class SnapshotState(enum.StrEnum):
    """Where an admitted snapshot stands, in order; ``status`` shows it."""

    COPYING = "copying"
    FLUSHING = "flushing"
    DURABLE = "durable"
    FAILED = "failed"


def _quiet(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # mark retrieved: a failure nobody waits for is still in status


class AdmittedSnapshot:
    """One snapshot the daemon admitted, from its copy to durable (or failed)."""

    def __init__(self, snapshot_id: int, client_id: str, tag: str, plan: FilePlan, regions: Sequence[Region],
                 decision: tuple[str, str] | None = None, owner_alive: Callable[[], bool] | None = None,
                 fences: Fences | None = None, folder: str = "") -> None:
        loop = asyncio.get_running_loop()
        self.id = snapshot_id
        self.client_id = client_id
        self.tag = tag
        self.path = plan.path
        self.folder = folder
        """Its tag's folder, where the tag's marker goes (commit.tag_folder), also while ``path`` is a new version's."""
        self.plan: FilePlan | None = plan
        self.regions: Sequence[Region] = regions
        self.total_bytes = plan.total_bytes
        self.file_size = plan.file_size
        self.snapshot = plan.header.snapshot
        """Which snapshot this is, as its file's header and its tag's marker record it."""
        self.decision = decision
        """(the client's decision folder, this snapshot's ticket): where the copy's outcome is agreed (protocol/outcome.py)."""
        self.owner_alive = owner_alive
        """Whether the trainer still lives, asked once its state in the trainer is copied (see ``mark_copied``)."""
        self.copied_bytes = 0
        """Tensor bytes in the daemon's memory (pool chunks or the replica's pages), counted as each segment lands."""
        self._copied_lock = threading.Lock()
        """Copy threads add to ``copied_bytes`` side by side (``add_copied``)."""
        self.flushed_bytes = 0
        """Tensor bytes written to the file (the event loop counts them as each piece's write returns)."""
        self.state = SnapshotState.COPYING
        self.error: str | None = None
        self.started = time.monotonic()
        self.first_copy_at: float | None = None
        """When its first bytes landed: what it waited before (its admission, a chunk, a copy thread) is its queueing."""
        self.copied_at: float | None = None
        self.finished: float | None = None
        self._copy_rate = RecentRate(self.started)
        self._flush_rate = RecentRate(self.started)
        self.replica: Replica | None = None
        """Where the engine also writes the file, for restores from memory (daemon/replica/table.py)."""
        self.abandoned: SnapshotFailedError | None = None
        """Set when the trainer went before the copy finished and its memory went with it."""
        self.fences = fences
        """The trainer's GPU work this snapshot's copies wait for, if any of its regions is ``fenced``
        (daemon/sources/cuda.py)."""
        self.copied: asyncio.Future = loop.create_future()
        self.durable: asyncio.Future = loop.create_future()
        for fut in (self.copied, self.durable):
            fut.add_done_callback(_quiet)

    @property
    def pending(self) -> bool:
        return self.state in (SnapshotState.COPYING, SnapshotState.FLUSHING)

    def abandon_trainer_copy(self, why: str) -> bool:
        """Stop copying from trainer memory that is gone; whether this snapshot had any left to copy.

        Shared memory outlives the trainer (the daemon maps it), so a snapshot of shared
        memory only still finishes; memory read in place (GPU memory, CPU memory read with
        process_vm_readv) does not, so its pieces not yet copied must not be read.
        """
        if self.state != SnapshotState.COPYING or not any(r.in_trainer for r in self.regions):
            return False
        self.abandoned = SnapshotFailedError(f"snapshot of {self.path} failed: {why} before its state was "
                                             "copied, and its memory went with it", path=self.path)
        return True

    def add_copied(self, nbytes: int) -> None:
        """Called by a copy thread as each segment's bytes land, so progress moves within a piece too."""
        with self._copied_lock:
            self.copied_bytes += nbytes
            if self.first_copy_at is None:
                self.first_copy_at = time.monotonic()

    def before_copy(self, region: Region) -> None:
        """Called by a copy thread before each read of ``region``: stop once the trainer's memory went."""
        if self.abandoned is not None:
            raise self.abandoned

    def stop_reason(self) -> str | None:
        """Why waiting on the trainer's GPU work is pointless now: it gave up on this snapshot, or it is gone."""
        if self.abandoned is not None:
            return self.abandoned.message
        if self.owner_alive is not None and not self.owner_alive():
            return "its trainer is gone"
        return None

    def mark_copied(self) -> None:
        """Every byte is in the daemon's hands, unless the trainer gave up on this snapshot first (then raises).

        The claim comes before WAIT is answered: a trainer that gave up has since changed its
        tensors, so bytes copied after that point may mix two steps and must never be written.

        A trainer that gave up is asked first: a trainer that gave up and left also counts as
        gone. A trainer that died before its state in its own memory was copied fails it too, even
        when the copy ran: where the driver aborts a dead process's kernels, the snapshot's
        event may complete without their results, so the bytes may predate the snapshot; and
        a pid reused mid-copy is another process. Asked after the last copy, a trainer still
        alive cannot have died during any of them.
        """
        if self.decision is not None and outcome.decide(*self.decision, outcome.COPIED) != outcome.COPIED:
            raise SnapshotFailedError(f"snapshot of {self.path} abandoned: the trainer gave up waiting for its copy "
                                      "(DaemonUnavailable) and may have changed the state since; nothing of it is "
                                      "written", path=self.path)
        if (self.owner_alive is not None and any(r.in_trainer for r in self.regions)
                and not self.owner_alive()):
            raise SnapshotFailedError(f"snapshot of {self.path} failed: its trainer died before its state was "
                                      "copied, so the bytes read may not be its (GPU kernels it had queued, a reused "
                                      "pid)", path=self.path)
        self.state = SnapshotState.FLUSHING
        self.copied_at = time.monotonic()
        self.regions = ()  # the daemon holds its own copy; the trainer's maps may go
        self.copied.set_result(None)

    def check_still_wanted(self) -> None:
        """Raise if the trainer went on saving in its own process: it writes this path itself now (protocol/outcome.py)."""
        if self.decision is not None and outcome.went_local(self.decision[0]):
            raise SnapshotFailedError(f"snapshot of {self.path} not written: its trainer lost the daemon and now saves "
                                      "its checkpoints itself (fallback='local')", path=self.path)

    def mark_durable(self) -> None:
        self.state = SnapshotState.DURABLE
        self._finish()
        self.durable.set_result(None)

    def mark_failed(self, exc: BaseException) -> None:
        self.state = SnapshotState.FAILED
        self.error = str(exc)
        self._finish()
        for fut in (self.copied, self.durable):
            if not fut.done():
                fut.set_exception(exc)

    def _finish(self) -> None:
        self.finished = time.monotonic()
        self.plan = None
        self.regions = ()
        self.fences = None

    def status(self) -> dict[str, Any]:
        """Progress and rates: ``copy_bps`` and ``flush_bps`` over the last RATE_WINDOW_S while their phase
        runs, the phase's average once it is over; ``throughput_bps`` is the rate of the phase the snapshot is in
        (copying, then flushing), and once it ended, the flushed bytes over its whole life."""
        now = time.monotonic()
        elapsed = (self.finished or now) - self.started
        copying = self.state == SnapshotState.COPYING
        copy_bps = self._copy_rate.rate(now, self.copied_bytes) if copying else \
            average(self.copied_bytes, (self.copied_at or self.finished or now) - self.started)
        flush_bps = self._flush_rate.rate(now, self.flushed_bytes) if self.pending else \
            average(self.flushed_bytes, elapsed)
        return {
            "id": self.id,
            "client": self.client_id,
            "tag": self.tag,
            "path": self.path,
            "state": self.state.value,
            "total_bytes": self.total_bytes,
            "copied_bytes": self.copied_bytes,
            "flushed_bytes": self.flushed_bytes,
            "elapsed_s": round(elapsed, 3),
            "queued_s": None if self.first_copy_at is None else round(self.first_copy_at - self.started, 4),
            "copied_s": None if self.copied_at is None else round(self.copied_at - self.started, 4),
            "since_s": round(now - self.started, 4),
            "copy_bps": copy_bps,
            "flush_bps": flush_bps,
            "throughput_bps": copy_bps if copying else flush_bps,
            "error": self.error,
        }
