"""Replicas: the daemon's own files of committed snapshots in /dev/shm, for restores that read no storage.

Most training faults are a dead trainer on a healthy node; its restart is fastest from
what the daemon still holds. With ``memory_restore: latest`` the engine's sink writes each
snapshot a second time, from the same pool chunks (no storage read), as a replica: a file
in the daemon's own folder under /dev/shm, within ``memory_restore_budget``. A replica
serves restores only once its tag is committed, and a file's older replicas are dropped
when a newer tag of it commits, so each rank keeps its newest committed snapshot. Files are
told apart by their rank file (the run folder above the tag folder, and the file's name:
rank3.pt under /ckpt), not by job id: a restarted job, with a new run id, still replaces
the replicas of the run it restarts.

A superseded replica that no restore was handed is not deleted but kept as its rank file's *spare*: the next replica of
that file is written over the spare's pages (renamed to its temporary name by the writer),
not into freshly allocated ones. Allocating, zeroing and later freeing /dev/shm pages was
most of the daemon's CPU per checkpoint (0.40 of 0.64 CPU-s for a 0.76 GB state, measured);
writing over kept pages costs half. The spare counts in ``used``: the budget already held
room for two replicas of a file while the newer one is written.

A replica is a plain checkpoint file in shared memory: the restarted trainer maps it with
``datastates.load``, which checks every checksum. The tag to restore is chosen from the
storage's commit markers, the same for every rank; a replica is used only if it is of that
tag, so ranks never mix steps (dlrover#1233).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from datastates.protocol.descriptors import Ranks
from datastates.protocol.paths import SHM_DIR

from .instances import Gone

log = logging.getLogger(__name__)

SHM_HEADROOM = 256 << 20
"""/dev/shm left free beyond a replica: trainers' shared tensors live there too."""


@dataclass
class Replica:
    job_id: int
    path: str
    """The snapshot's file on storage."""
    file: str
    """The replica itself: a checkpoint file under the daemon's /dev/shm folder."""
    size: int
    tag: str
    rank: tuple[str, int]
    committed: bool = False
    spare: str = ""
    """A superseded replica's file of the same rank file, for the writer to write over (or "")."""
    in_place: bool = False
    """Its pages were filled by the copies themselves, and the file on storage written from them (no copy of its own)."""
    served: bool = False
    """A restore was handed this file: a trainer may map it (copy-on-write, which still shows the file's later
    changes on pages it has not written), so its pages are never written over, only unlinked."""

    @property
    def rank_file(self) -> tuple[str, str]:
        return rank_file(self.path)


def rank_file(path: str) -> tuple[str, str]:
    """The run folder above the tag folder and the file's name: one rank's file, tag after tag, in a run or its restart."""
    return os.path.dirname(os.path.dirname(path)), os.path.basename(path)


@dataclass
class _Spare:
    file: str
    size: int


def _folder_prefix() -> str:
    return os.path.join(SHM_DIR, f"datastates-{os.geteuid()}-")


def _unlink(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_gone(gone: Gone) -> list[str]:
    """The replica folders of killed daemons of this node (``gone`` owners), deleted: no one can restore from them."""
    removed = []
    prefix = _folder_prefix()
    for name in os.listdir(SHM_DIR):
        folder = os.path.join(SHM_DIR, name)
        if folder.startswith(prefix) and gone(folder[len(prefix):], folder) and not os.path.islink(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class ReplicaStore:
    def __init__(self, policy: str, budget: int, owner: str, on_removed: Callable[[], None] = lambda: None) -> None:
        self.policy = policy
        self._on_removed = on_removed
        """Called once files were removed: the storage writer may still map them (their pages are freed then)."""
        self.budget = budget
        self.folder = _folder_prefix() + owner
        self._held: dict[int, Replica] = {}
        self._spares: dict[tuple[str, str], _Spare] = {}
        """Per rank file, the file of its last superseded replica, for the next one to write over."""
        self.used = 0
        """Bytes of every replica held or being written, and of the spares."""
        if policy != "none":
            os.makedirs(self.folder, mode=0o700, exist_ok=True)

    def reserve(self, job_id: int, path: str, tag: str, size: int, ranks: Ranks) -> Replica | None:
        """A replica to write for snapshot ``job_id``, or None when the policy is off or the budget or /dev/shm has no room."""
        if self.policy == "none":
            return None
        spare = self._spares.pop(rank_file(path), None)
        if spare is not None:
            self.used -= spare.size  # becomes this replica's file, or goes
        if self.used + size > self.budget:
            self._remove(spare.file if spare else "")
            log.info("no replica of %s: %d bytes over memory_restore_budget (%d of %d used)",
                     path, size, self.used, self.budget)
            return None
        if not os.path.isdir(self.folder):  # removed under the daemon (a /dev/shm clean-up, systemd's RemoveIPC)
            os.makedirs(self.folder, mode=0o700, exist_ok=True)
        st = os.statvfs(self.folder)
        if st.f_bavail * st.f_frsize + (spare.size if spare else 0) < size + SHM_HEADROOM:
            log.info("no replica of %s: /dev/shm has too little room", path)
            self._remove(spare.file if spare else "")
            return None
        replica = Replica(job_id, path, os.path.join(self.folder, f"{job_id}-{os.path.basename(path)}"), size,
                          tag, (ranks.job, ranks.rank), spare=spare.file if spare else "")
        self._held[job_id] = replica
        self.used += size
        return replica

    def discard(self, job_id: int) -> None:
        replica = self._held.pop(job_id, None)
        if replica is not None:
            self.used -= replica.size
            self._remove(replica.file, replica.spare)  # the spare is still there if its write never started

    def _supersede(self, replica: Replica) -> None:
        """A newer replica of its rank file is committed: keep its file as that rank file's spare, unless a
        trainer may have it mapped."""
        if replica.served:
            self.discard(replica.job_id)
            return
        self._held.pop(replica.job_id, None)
        old = self._spares.pop(replica.rank_file, None)
        if old is not None:
            self.used -= old.size
            self._remove(old.file)
        spare = os.path.join(self.folder, f"spare-{replica.job_id}")
        try:
            os.rename(replica.file, spare)
        except OSError:  # never written (a failed snapshot), or removed under the daemon
            self.used -= replica.size
            self._remove(replica.spare)
            return
        self._remove(replica.spare)
        self._spares[replica.rank_file] = _Spare(spare, replica.size)

    def _remove(self, *paths: str) -> None:
        for path in paths:
            _unlink(path)
        if any(paths):
            self._on_removed()

    def committed(self, tag: str, job_ids: Iterable[int]) -> None:
        """Snapshots ``job_ids`` (one client's, of ``tag``) are committed: their replicas serve restores, older ones of each file go."""
        for job_id in job_ids:
            replica = self._held.get(job_id)
            if replica is None:
                continue
            replica.committed = True
            for old in [r for r in self._held.values()
                        if r.rank_file == replica.rank_file and r.job_id < replica.job_id and r.tag != tag]:
                self._supersede(old)

    def lookup(self, path: str, tag: str, size: int) -> tuple[Replica | None, str]:
        """The committed replica of ``path`` for ``tag``, or None and why not."""
        if self.policy == "none":
            return None, "memory_restore is none on this daemon"
        found = [r for r in self._held.values() if r.path == path]
        if not found:
            return None, "the daemon holds no replica of it (not kept: over budget, or the daemon restarted)"
        match = [r for r in found if r.tag == tag and r.committed and r.size == size and os.path.exists(r.file)]
        if not match:
            return None, f"the daemon's replica is of another tag ({', '.join(sorted({r.tag for r in found}))})"
        replica = max(match, key=lambda r: r.job_id)
        replica.served = True
        return replica, ""

    def close(self) -> None:
        """A stopped daemon's replicas serve no one: the next daemon knows nothing of them."""
        if self.policy != "none":
            shutil.rmtree(self.folder, ignore_errors=True)

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget,
            "used_bytes": self.used,
            "spare_bytes": sum(sp.size for sp in self._spares.values()),
            "folder": self.folder,
            "replicas": [{"tag": r.tag, "path": r.path, "file": r.file, "size": r.size, "rank": r.rank[1], "job": r.rank[0],
                          "committed": r.committed, "in_place": r.in_place} for r in self._held.values()],
        }
