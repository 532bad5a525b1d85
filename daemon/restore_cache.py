"""The daemon's in-memory copies of committed snapshots, for restores that read no storage.

Most training faults are a dead trainer on a healthy node; its restart is fastest from
what the daemon still holds. With ``memory_restore: latest`` the engine writes each
snapshot a second time, from the same pool chunks (no storage read), into a file in the
daemon's own folder under /dev/shm, within ``memory_restore_budget``. A copy serves
restores only once its tag is committed, and a file's older copies are dropped when a newer
tag of it commits, so each rank keeps its newest committed snapshot. Files are told apart by
series (the root above the tag folder, and the file's name: rank3.pt under /ckpt), not by
job id: a restarted job, with a new run id, still replaces the copies of the run it restarts.

A copy is a plain checkpoint file in shared memory: the restarted trainer maps it with
``datastates.load``, which checks every checksum. The tag to restore is chosen from the
storage's commit markers, the same for every rank; a copy is used only if it is of that
tag, so ranks never mix steps (dlrover#1233).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import DatastatesError

from .job import SnapshotJob
from .storage import StorageWriter

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_HEADROOM = 256 << 20
"""/dev/shm left free beyond a copy: trainers' shared tensors live there too."""


@dataclass
class Kept:
    job_id: int
    path: str
    """The snapshot's file on storage."""
    copy: str
    """Its copy under the daemon's /dev/shm folder."""
    size: int
    tag: str
    rank: tuple[str, int]
    committed: bool = False

    @property
    def series(self) -> tuple[str, str]:
        """The root above the tag folder and the file's name: one rank's file, tag after tag, in a run or its restart."""
        return os.path.dirname(os.path.dirname(self.path)), os.path.basename(self.path)


class Mirror:
    """The second writer of one snapshot; its failures only drop the copy, never fail the snapshot."""

    def __init__(self, writer: StorageWriter, kept: Kept) -> None:
        self._writer = writer
        self.kept = kept
        self._handle: Any = None
        self.failed = False

    def create(self, owner: str) -> None:
        self._guard(lambda: setattr(self, "_handle", self._writer.create(self.kept.copy, owner)))

    def write(self, offset: int, data: memoryview) -> None:
        self._guard(lambda: self._writer.write(self._handle, offset, data))

    def write_header(self, write_header: Callable[..., None], *args: Any) -> None:
        """``write_header(writer, handle, *args)``: the engine's header step, on this copy."""
        self._guard(lambda: write_header(self._writer, self._handle, *args))

    def finalize(self) -> None:
        self._guard(lambda: self._writer.finalize(self._handle))

    def abort(self) -> None:
        if self._handle is not None and not self.failed:
            self.failed = True
            self._writer.abort(self._handle)

    def _guard(self, step: Any) -> None:
        if self.failed:
            return
        try:
            step()
        except DatastatesError as exc:
            log.warning("in-memory copy of %s dropped: %s", self.kept.path, exc)
            self.abort()
            self.failed = True


class RestoreCache:
    def __init__(self, policy: str, budget: int, owner: str) -> None:
        self.policy = policy
        self.budget = budget
        self.folder = os.path.join(SHM_DIR, f"datastates-{os.geteuid()}-{owner}")
        self._kept: dict[int, Kept] = {}
        self.used = 0
        """Bytes of every copy kept or being written."""
        if policy != "none":
            shutil.rmtree(self.folder, ignore_errors=True)  # an earlier run's copies: their tags may be gone
            os.makedirs(self.folder, mode=0o700, exist_ok=True)

    def reserve(self, job: SnapshotJob, ranks: Ranks) -> Kept | None:
        """A copy to write for ``job``, or None when the policy is off or the budget or /dev/shm has no room."""
        if self.policy == "none":
            return None
        size = job.file_size
        if self.used + size > self.budget:
            log.info("no in-memory copy of %s: %d bytes over memory_restore_budget (%d of %d used)",
                     job.path, size, self.used, self.budget)
            return None
        st = os.statvfs(self.folder)
        if st.f_bavail * st.f_frsize < size + SHM_HEADROOM:
            log.info("no in-memory copy of %s: /dev/shm has too little room", job.path)
            return None
        kept = Kept(job.id, job.path, os.path.join(self.folder, f"{job.id}-{os.path.basename(job.path)}"), size,
                    job.tag, (ranks.job, ranks.rank))
        self._kept[job.id] = kept
        self.used += size
        return kept

    def discard(self, job_id: int) -> None:
        kept = self._kept.pop(job_id, None)
        if kept is not None:
            self.used -= kept.size
            try:
                os.unlink(kept.copy)
            except FileNotFoundError:
                pass

    def committed(self, tag: str, jobs: Iterable[SnapshotJob]) -> None:
        """``jobs`` (one client's, of ``tag``) are committed: their copies serve restores, older ones of each file go."""
        for job in jobs:
            kept = self._kept.get(job.id)
            if kept is None:
                continue
            kept.committed = True
            for old in [k for k in self._kept.values()
                        if k.series == kept.series and k.job_id < kept.job_id and k.tag != tag]:
                self.discard(old.job_id)

    def lookup(self, path: str, tag: str, size: int) -> tuple[Kept | None, str]:
        """The committed copy of ``path`` for ``tag``, or None and why not."""
        if self.policy == "none":
            return None, "memory_restore is none on this daemon"
        found = [k for k in self._kept.values() if k.path == path]
        if not found:
            return None, "the daemon holds no copy of it (not kept: over budget, or the daemon restarted)"
        match = [k for k in found if k.tag == tag and k.committed and k.size == size and os.path.exists(k.copy)]
        if not match:
            return None, f"the daemon's copy is of another tag ({', '.join(sorted({k.tag for k in found}))})"
        return max(match, key=lambda k: k.job_id), ""

    def close(self) -> None:
        """A stopped daemon's copies serve no one: the next daemon knows nothing of them."""
        if self.policy != "none":
            shutil.rmtree(self.folder, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget,
            "used_bytes": self.used,
            "copies": [{"tag": k.tag, "path": k.path, "size": k.size, "rank": k.rank[1], "job": k.rank[0],
                        "committed": k.committed} for k in self._kept.values()],
        }
