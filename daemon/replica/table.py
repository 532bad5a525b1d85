"""The table of replicas: which of the daemon's committed snapshots it keeps in /dev/shm, within its budget.

Most training faults are a dead trainer on a healthy node; its restart is fastest from
what the daemon still holds. With ``memory_restore: latest`` the engine's sink writes each
snapshot a second time, from the same pool chunks (no storage read), as a replica: a file
in the daemon's own folder under /dev/shm, within ``memory_restore_budget``. A replica
serves restores only once its tag is committed, and only for the snapshot its tag's marker
lists (its identity, ``FileHeader.snapshot``): a tag saved again (a rolling ``last``) lists
its newest version, never an older one the daemon may still hold. The store follows the
ledger's commits (a ``CommitListener``): each commit retires every replica of its files'
rank files that it supersedes, of its own tag too, so each rank keeps its newest
committed snapshot, and old versions never fill the budget. Files are
told apart by their rank file (the run folder above the tag folder, and the file's name:
rank3.pt under /ckpt), not by job id: a restarted job, with a new run id, still replaces
the replicas of the run it restarts.

A superseded replica that no restore was handed is not deleted but kept as its rank file's *spare*: the next replica of
that file is written over the spare's pages (renamed to its temporary name by the backend, backend.py),
not into freshly allocated ones. Allocating, zeroing and later freeing /dev/shm pages was
most of the daemon's CPU per checkpoint (0.40 of 0.64 CPU-s for a 0.76 GB state, measured);
writing over kept pages costs half. The spare counts in ``used``: the budget already held
room for two replicas of a file while the newer one is written.

A rank file's first replica has no spare to be written over, nor has the next one (the first
is still the newest committed): their fresh pages were allocated while their copies ran, and
on two cores the first checkpoints' fences took 2-4 x the later ones'. So once a rank file's
first replica is committed, a spare of its size is allocated in the background
(``prepare``, on a flush thread, between checkpoints), where the budget has room for it and
the next replica. Its pages are mapped then too, as are a superseded replica's that was written
rather than filled in place: a replica filled over a spare mapped on its own path waited
0.05-0.1 s more at the fence (0.76 GB).

A rank file that is not saved again (a finished run, a dropped rank, a run folder its process moved on from)
would hold its replica and spare for as long as the daemon lives, and a new run's files would find no room. So
when a new replica does not fit, the store releases what no one saves any more: the spares, then the replicas,
of the rank files whose last saver is gone, or has begun two newer tags since (more, for a file it saves once every
few tags), least recently saved or restored first (``_release_stale``). Never a rank file still saved, nor the
replica a connected client was handed by a restore (it may be reading it now): a job's restart seconds after its
clients went still finds its newest replicas unless another file needed their room.

A replica is a plain checkpoint file in shared memory: the restarted trainer maps it with
``datastates.load``, which checks every checksum. The tag to restore is chosen from the
storage's commit markers, the same for every rank; a replica is used only if it is of that
tag, so ranks never mix steps (dlrover#1233).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from datastates.protocol.descriptors import Ranks

from ..events import CommitEvent
from .folder import ReplicaFolder
from .locks import PageLocks

log = logging.getLogger(__name__)


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
    snapshot: str
    """Which snapshot it holds (``FileHeader.snapshot``): it serves a restore only if its tag's marker lists that one."""
    committed: bool = False
    spare: str = ""
    """A superseded replica's file of the same rank file, for the writer to write over (or "")."""
    in_place: bool = False
    """Its pages were filled by the copies themselves, and the file on storage written from them (no copy of its own)."""
    served: bool = False
    """A restore was handed this file: a trainer may map it (copy-on-write, which still shows the file's later
    changes on pages it has not written), so its pages are never written over, only unlinked."""
    readers: set[str] = field(default_factory=set)
    """The clients a restore handed it to: while one is connected it may be reading it, and it is never released
    for another file's room."""

    @property
    def rank_file(self) -> tuple[str, str]:
        return rank_file(self.path)


def rank_file(path: str) -> tuple[str, str]:
    """The run folder above the tag folder and the file's name: one rank's file, tag after tag, in a run or its restart."""
    return os.path.dirname(os.path.dirname(path)), os.path.basename(path)


@dataclass
class _Use:
    """Who saved a rank file last and when: whether it is still saved, and which goes first when room is short."""

    saver: str
    """The client that saved it last."""
    round: int
    """Its saver's tag count (``ReplicaStore._rounds``) at that save."""
    last: int
    """The store's clock at its last save or restore."""
    every: int = 1
    """How many of its saver's tags its last two saves were apart (1: each tag saves it): a client saving several
    run folders in turn, each under a tag of its own, saves each of their rank files once every few tags."""


@dataclass
class _Spare:
    file: str
    size: int
    ahead: bool = False
    """Allocated ahead (``prepare``), not a superseded replica: dropped first when a replica needs the room."""


def _spare_key(rank: tuple[str, str]) -> tuple[str, str, str]:
    """The key a spare's locked pages are held under in ``PageLocks`` (a replica's is its job id)."""
    return ("spare", *rank)


ReadyAhead = Callable[[str, int, Callable[[BaseException | None], None]], None]
"""Makes the first bytes of a spare file ready (allocated and mapped: ``MemoryStorage.ready_pages``) off the event loop,
then calls its last argument on the loop with what that raised (or None)."""


class ReplicaStore:
    """The replicas held and the spares kept, per rank file, within the budget: which to write, serve and release."""

    def __init__(self, policy: str, budget: int, owner: str, alive: Callable[[str], bool],
                 on_removed: Callable[[], None] = lambda: None, ready_ahead: ReadyAhead | None = None) -> None:
        self.policy = policy
        self._alive = alive
        """Whether a client (by id) is still connected."""
        self._uses: dict[tuple[str, str], _Use] = {}
        """Per rank file the store holds something of (or saves now), its last save or restore."""
        self._rounds: dict[str, tuple[str, int]] = {}
        """Per connected client that saved, its last tag and how many tags it began."""
        self._clock = 0
        self.released = 0
        """Replicas and spares released for another file's room (``_release_stale``), and their bytes."""
        self.released_bytes = 0
        self._ready_ahead = ready_ahead
        """Readies a spare's pages off the fence's path, a spare allocated ahead (``prepare``) and a superseded
        replica's alike; None: neither."""
        self._making: dict[tuple[str, str], int] = {}
        """Rank files whose spare is being allocated, and its size (counted in ``used``)."""
        self.budget = budget
        self._folder = ReplicaFolder(owner, on_removed)
        self._held: dict[int, Replica] = {}
        self._spares: dict[tuple[str, str], _Spare] = {}
        """Per rank file, the file of its last superseded replica, for the next one to write over."""
        self.used = 0
        """Bytes of every replica held or being written, and of the spares."""
        self._locks = PageLocks()
        """The committed replicas' pages, locked in memory (locks.py)."""
        if policy != "none":
            self._folder.make()

    def reserve(self, job_id: int, path: str, tag: str, size: int, ranks: Ranks, snapshot: str,
                client: str) -> Replica | None:
        """A replica to write for snapshot ``job_id`` of ``client``, or None when the policy is off or the budget or
        /dev/shm has no room."""
        if self.policy == "none":
            return None
        self._locks.release_removed()  # replicas removed under the daemon: their locked pages go
        self._saved(rank_file(path), tag, client)
        spare = self._spares.pop(rank_file(path), None)
        spare_key = _spare_key(rank_file(path))
        if spare is not None:
            self.used -= spare.size  # becomes this replica's file, or goes
        for key in [k for k, sp in self._spares.items() if sp.ahead]:
            if self.used + size <= self.budget:
                break
            dropped = self._spares.pop(key)  # another rank file's, allocated ahead: a replica needs the room more
            self.used -= dropped.size
            self._folder.remove(dropped.file)
        self._release_stale(size)
        if self.used + size > self.budget:
            self._locks.unpin(spare_key)
            self._folder.remove(spare.file if spare else "")
            log.info("no replica of %s: %d bytes over memory_restore_budget (%d of %d used)",
                     path, size, self.used, self.budget)
            return None
        self._folder.make()
        if not self._folder.has_room(size, spare.size if spare else 0):
            log.info("no replica of %s: /dev/shm has too little room", path)
            self._locks.unpin(spare_key)
            self._folder.remove(spare.file if spare else "")
            return None
        replica = Replica(job_id, path, self._folder.replica_file(job_id, path), size, tag, (ranks.job, ranks.rank),
                          snapshot, spare=spare.file if spare else "")
        self._held[job_id] = replica
        self._locks.move(spare_key, job_id)  # its pages, locked as a spare, are this replica's (the writer renames it)
        self.used += size
        return replica

    def discard(self, job_id: int) -> None:
        replica = self._held.pop(job_id, None)
        if replica is not None:
            self._locks.unpin(job_id)
            self.used -= replica.size
            self._folder.remove(replica.file, replica.spare)  # the spare is still there if its write never started

    def _supersede(self, replica: Replica) -> None:
        """A newer replica of its rank file is committed: keep its file as that rank file's spare, unless a
        trainer may have it mapped."""
        if replica.served:
            self.discard(replica.job_id)
            return
        self._held.pop(replica.job_id, None)
        key = _spare_key(replica.rank_file)
        old = self._spares.pop(replica.rank_file, None)
        self._locks.unpin(key)
        if old is not None:
            self.used -= old.size
            self._folder.remove(old.file)
        spare = self._folder.keep_as_spare(replica.file, replica.job_id)
        if not spare:
            self._locks.unpin(replica.job_id)
            self.used -= replica.size
            self._folder.remove(replica.spare)
            return
        self._locks.move(replica.job_id, key)  # its pages stay locked for the next replica written over them
        self._folder.remove(replica.spare)
        self._spares[replica.rank_file] = _Spare(spare, replica.size)
        if self._ready_ahead is not None:  # a replica written, not filled in place: its pages are not mapped

            def mapped(error: BaseException | None) -> None:
                if error is not None:  # its next replica maps it itself
                    log.info("spare %s not mapped ahead: %s", spare, error)

            self._ready_ahead(spare, replica.size, mapped)

    def _saved(self, key: tuple[str, str], tag: str, client: str) -> None:
        """``client`` saves rank file ``key`` for ``tag``: its use now, and the client's tag count."""
        if client not in self._rounds:  # the clients gone since forget their counts: none saves again
            self._rounds = {c: r for c, r in self._rounds.items() if self._alive(c)}
        last, count = self._rounds.get(client, ("", 0))
        self._rounds[client] = (tag, count + (tag != last))
        if key not in self._uses:  # the rank files the store holds nothing of any more forget their uses
            held = {r.rank_file for r in self._held.values()} | set(self._spares) | set(self._making)
            self._uses = {k: u for k, u in self._uses.items() if k in held}
        self._clock += 1
        now, before = self._rounds[client][1], self._uses.get(key)
        every = 1
        if before is not None and before.saver == client:
            every = before.every if now == before.round else now - before.round
        self._uses[key] = _Use(client, now, self._clock, every)

    def _stale(self, key: tuple[str, str]) -> bool:
        """Whether no one saves rank file ``key`` any more: its last saver is gone, or began two newer tags since
        than its saves are apart (one newer tag is the next save, which may not be committed yet)."""
        use = self._uses.get(key)
        if use is None:
            return True
        if not self._alive(use.saver):
            return True
        return self._rounds.get(use.saver, ("", 0))[1] >= use.round + use.every + 1

    def _release_stale(self, size: int) -> None:
        """Make room for ``size`` more bytes from rank files no one saves any more: their spares first, then their
        replicas (committed, or written and never committed), least recently saved or restored first; never a
        replica a connected client was handed by a restore."""
        if self.used + size <= self.budget:
            return
        for key in sorted((k for k in self._spares if self._stale(k)), key=self._last_use):
            if self.used + size <= self.budget:
                return
            spare = self._spares.pop(key)
            self._locks.unpin(_spare_key(key))
            self.used -= spare.size
            self._folder.remove(spare.file)
            self._count_released(spare.size)
        for replica in sorted((r for r in self._held.values() if self._stale(r.rank_file)
                               and not any(self._alive(c) for c in r.readers)
                               and (r.committed or os.path.exists(r.file))), key=lambda r: self._last_use(r.rank_file)):
            if self.used + size <= self.budget:
                return
            self.discard(replica.job_id)
            self._count_released(replica.size)

    def _last_use(self, key: tuple[str, str]) -> int:
        use = self._uses.get(key)
        return -1 if use is None else use.last

    def _count_released(self, size: int) -> None:
        self.released += 1
        self.released_bytes += size

    def committed(self, commit: CommitEvent) -> None:
        """``commit``'s files are committed (at the paths readers see): the replicas of the snapshots it lists serve
        restores, and every older replica of the same rank files goes, of its own tag too: the committed ones, and
        those left uncommitted (a save of a failed commit) once written. Those of the commit's files that have no
        replica (over budget) supersede just the same. Never one this commit lists (files of one tag in sibling
        folders share a rank file: step/model/rank0.pt, step/optim/rank0.pt), nor a newer snapshot's (a retried
        commit of an older tag, landing after a newer tag's)."""
        for path, snapshot in commit.snapshots.items():
            current = next((r for r in self._held.values() if r.path == path and r.snapshot == snapshot), None)
            if current is not None:
                current.committed = True
                self._locks.pin(current.job_id, current.file, current.size)
            newest = current.job_id if current is not None else commit.order
            for old in [r for r in self._held.values() if r.rank_file == rank_file(path)
                        and commit.snapshots.get(r.path) != r.snapshot and r.job_id < newest
                        and (r.committed or (current is not None and os.path.exists(r.file)))]:  # exists: written
                self._supersede(old)
            if current is not None:  # after the superseded ones became spares: none did for a first replica
                self.prepare(current)

    def prepare(self, replica: Replica) -> None:
        """Allocate a spare for ``replica``'s rank file in the background, if it has none and the budget and /dev/shm
        have room for it and for the next replica: that one is then written over pages that exist, as in the steady
        state. Another rank file's replica that needs the room takes it back (``reserve``)."""
        key = replica.rank_file
        if self._ready_ahead is None or key in self._spares or key in self._making:
            return
        if self.used + 2 * replica.size > self.budget:  # the spare, and the next replica while it is allocated
            return
        if not self._folder.has_room(2 * replica.size):
            return
        try:
            file = self._folder.new_spare(replica.job_id)
        except OSError as exc:
            log.info("no spare allocated ahead for %s: %s", replica.path, exc)
            return
        self.used += replica.size
        self._making[key] = replica.size

        def made(error: BaseException | None) -> None:
            self._making.pop(key, None)
            if error is None and key not in self._spares:
                self._spares[key] = _Spare(file, replica.size, ahead=True)
                return
            self.used -= replica.size  # failed, or a superseded replica became the spare meanwhile
            self._folder.remove(file)
            if error is not None:
                log.info("no spare allocated ahead for %s: %s", replica.path, error)

        self._ready_ahead(file, replica.size, made)

    def pruned(self, folders: list[str]) -> None:
        """Nothing to do: retention deletes a run's older tags, whose replicas went when newer ones committed."""

    def holds(self) -> set[str]:
        """Replicas hold no tag on storage."""
        return set()

    def lookup(self, path: str, tag: str, size: int, snapshot: str, reader: str) -> tuple[Replica | None, str]:
        """The committed replica of ``path`` for ``tag`` holding ``snapshot`` (what its marker lists), or None and why
        not; handed to client ``reader``."""
        if self.policy == "none":
            return None, "memory_restore is none on this daemon"
        found = [r for r in self._held.values() if r.path == path]
        if not found:
            return None, "the daemon holds no replica of it (not kept: over budget, or the daemon restarted)"
        if not any(r.tag == tag for r in found):
            return None, f"the daemon's replica is of another tag ({', '.join(sorted({r.tag for r in found}))})"
        match = [r for r in found if r.tag == tag and r.snapshot == snapshot and r.committed and r.size == size
                 and os.path.exists(r.file)]
        if not all(os.path.exists(r.file) for r in found):
            self._locks.release_removed()
        if not snapshot or not match:
            return None, (f"the daemon holds no replica of the version of tag {tag!r} its marker lists "
                          f"(snapshot {snapshot or 'not named'}), only of another version")
        match[0].served = True
        match[0].readers.add(reader)
        use = self._uses.get(match[0].rank_file)
        if use is not None:
            self._clock += 1
            use.last = self._clock
        return match[0], ""

    def close(self) -> None:
        """A stopped daemon's replicas serve no one: the next daemon knows nothing of them."""
        self._locks.close()
        if self.policy != "none":
            self._folder.close()

    def status(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget,
            "used_bytes": self.used,
            "spare_bytes": sum(sp.size for sp in self._spares.values()) + sum(self._making.values()),
            "spares_allocating": len(self._making),
            "locked_bytes": self._locks.locked_bytes,
            "locks_pending": self._locks.pending,
            "lock_refused": self._locks.refused,
            "folder": self._folder.path,
            "released": self.released,
            "released_bytes": self.released_bytes,
            "replicas": [{"tag": r.tag, "path": r.path, "file": r.file, "size": r.size, "rank": r.rank[1], "job": r.rank[0],
                          "snapshot": r.snapshot, "committed": r.committed, "in_place": r.in_place}
                         for r in self._held.values()],
        }
