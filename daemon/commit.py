"""Commit: a tag becomes committed when all its files are durable and its marker is in place.

The marker lists every file of the tag with its size; it is written under a temporary
name, fsynced and renamed into the tag's folder. Readers trust nothing else
(client/reader.py). A job of one client commits its own files. In a job of many ranks
the daemon gathers its node's ranks first; across nodes the daemons never talk, they
meet on the shared file system, as DLRover's done-files and DCP's metadata-last rename
do: each node writes a durable done marker of its files, node 0 waits for all of them
and then writes the tag's marker and the ``latest`` trackers, and the other nodes wait
for that marker. A node that never reports leaves the tag uncommitted.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from datastates.protocol import messages as m
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import (
    CommitError,
    DatastatesError,
    PathNotAllowedError,
    SnapshotFailedError,
    SnapshotSkippedError,
    StorageError,
)
from datastates.protocol.fileio import remove
from datastates.protocol.format import MEGATRON_TRACKER, TRACKER, CommitMarker, MarkerFile, done_name, marker_name
from datastates.protocol.version import COMMIT_VERSION

from datastates.protocol.paths import within
from datastates.protocol.retention import prune
from datastates.protocol.tags import listing, next_sequence, tag_files, unlisted

from .config import HISTORY, StorageConfig
from .engine import Engine
from .events import CommitEvent, CommitListener
from .gather import Attempt, NodeGather, still_reported
from .snapshot import AdmittedSnapshot
from .versions import NewVersion, Versions

log = logging.getLogger(__name__)

_ITERATION_RE = re.compile(r"^iter_(\d+)$")


def tag_folder(tag: str, files: dict[str, int], roots: list[str] | None) -> str:
    """Where the tag's marker goes: the nearest folder above its files named after the tag, else their common folder.

    The tag-named folder is one every node finds by itself (DeepSpeed's global_step<N>,
    Megatron's iter_<N>), even when each node holds files in different subfolders.
    """
    common = os.path.commonpath([os.path.dirname(p) for p in files])
    if roots is not None and not any(within(common, r) for r in roots):
        raise CommitError(f"tag {tag!r} spans folders with no common folder inside the roots", tag=tag)
    folder = common
    while os.path.basename(folder) != tag:
        parent = os.path.dirname(folder)
        if parent == folder or (roots is not None and not any(within(parent, r) for r in roots)):
            return common
        folder = parent
    return folder


def make_marker(tag: str, files: dict[str, int], folder: str, requested_ns: int, sequence: int, nodes: int = 1,
                node: int = -1, snapshots: dict[str, str] | None = None, job: str = "", owner: str = "",
                began_ns: int = 0) -> CommitMarker:
    return CommitMarker(
        version=COMMIT_VERSION,
        tag=tag,
        committed_ns=time.time_ns(),
        files=[MarkerFile(path=os.path.relpath(p, folder), size=n, snapshot=(snapshots or {}).get(p, ""))
               for p, n in files.items()],
        requested_ns=requested_ns,
        nodes=nodes,
        node=node,
        sequence=sequence,
        job=job,
        owner=owner,
        began_ns=began_ns,
    )


def trackers(tag: str, folder: str) -> dict[str, bytes]:
    """The tracker files beside the tag folder that frameworks read to find the newest checkpoint."""
    parent = os.path.dirname(folder)
    out = {os.path.join(parent, TRACKER): tag.encode()}
    iteration = _ITERATION_RE.match(tag)
    if iteration:
        out[os.path.join(parent, MEGATRON_TRACKER)] = str(int(iteration.group(1))).encode()
    return out


@dataclass
class _TagGroup:
    """One tag of one multi-rank job on this node, while its local ranks commit."""

    ranks: Ranks
    done: asyncio.Future
    requested_ns: int
    """When the node's first rank asked to commit the tag: ranks commit tags in order, so groups are created in order."""
    committed: set[int] = field(default_factory=set)
    """Ranks whose COMMIT arrived."""
    durable: int = 0
    """Of those, how many have all their files durable: the one that makes it local_world_size finishes."""
    files: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)
    order: int = 0
    """The newest snapshot id among the node's files: see CommitLedger._tracked."""
    sequence: int = 0
    """The sequence of the node's first rank to ask (that named a file): the tag's place among the job's tags."""
    paths: set[str] = field(default_factory=set)
    """The files of the ranks that committed: the version they make is sealed once the node's last rank has (until
    then the other ranks' snapshots of the tag join it, as DCP's coordinator saves its metadata after the others
    asked to commit)."""
    clients: set[str] = field(default_factory=set)
    """The clients whose COMMIT joined the round and have not died: once none is left, none is left to tell."""
    began_ns: int = 0
    """When the first of those clients' processes started (0: unknown): where this attempt of the job began."""

    @classmethod
    def start(cls, ranks: Ranks, requested_ns: int) -> _TagGroup:
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return cls(ranks=ranks, done=done, requested_ns=requested_ns)

    @property
    def failed(self) -> bool:
        """It failed, and waits only to tell the node's ranks still to commit it (see ``CommitLedger._fail_round``)."""
        return self.done.done() and not self.done.cancelled() and self.done.exception() is not None

    def fail(self, exc: CommitError) -> None:
        """The round fails with ``exc``, unless it ended already."""
        if not self.done.done():
            self.done.set_exception(exc)


class CommitLedger:
    def __init__(self, engine: Engine, storage: StorageConfig, timeout: float, versions: Versions, owner: str) -> None:
        self._engine = engine
        self._owner = owner
        self._versions = versions
        self._storage = storage
        self._roots = storage.roots
        self._timeout = timeout
        self._nodes = NodeGather(engine, timeout)
        self._listeners: list[CommitListener] = []
        self._open: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        self._committing: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        """Snapshots whose COMMIT is under way, until it is answered."""
        self._failed: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        """Snapshots of a commit that failed: a commit with no new snapshot of the tag retries them (see ``commit``)."""
        self._skipped: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._refused: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        """Tags one of whose snapshots was refused at admission, or part of which went with a daemon the client lost
        (COMMIT ``lost``): committing the rest would make a partial tag. → why, as the commit's error says it."""
        self._groups: dict[tuple[str, int, str], _TagGroup] = {}
        self._tracker_lock = asyncio.Lock()
        self._tracked: dict[str, tuple[int, int]] = {}
        """Per tracker file, the (sequence, snapshot id) of the tag it names: commits that finish out of order never move it back."""
        self._sequences: dict[str, int] = {}
        """Per run folder, the last sequence handed out: read from its markers once, then counted here."""
        self._sequence_lock = asyncio.Lock()
        self.committed: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.pending = 0

    def subscribe(self, listener: CommitListener) -> None:
        self._listeners.append(listener)

    def check_owner(self, path: str, client_id: str, tag: str, alive: Callable[[str], bool]) -> None:
        """Refuse ``path`` while another tag, or another live client, holds an uncommitted snapshot of it (open,
        being committed, or kept for a retry): one of the two states would be lost, or a tag's marker would name
        the other's bytes once its commit lands. A client that is gone (a killed trainer whose restart saves the
        same step) holds nothing, except a snapshot whose commit is under way: its marker may land at any moment
        (the COMMIT came before the client went: a trainer that reconnected after a stall, as a new client).
        """
        for table in (self._open, self._committing, self._failed):
            for (other, held), jobs in list(table.items()):
                if not any(j.path == path for j in jobs):
                    continue
                if other != client_id and (table is self._committing or alive(other)):
                    raise PathNotAllowedError(f"path {path!r} refused: client {other} is saving it for tag {held!r}, "
                                              "not yet committed; two clients must not write one file", path=path)
                if other == client_id and held != tag:
                    state = "whose commit failed (commit it again to retry)" if table is self._failed else "not yet committed"
                    raise PathNotAllowedError(f"path {path!r} refused: this client saved it for tag {held!r}, {state}; "
                                              f"a file belongs to one tag (save {tag!r} elsewhere)", path=path)

    def check_tag_owner(self, tag: str, folder: str, client_id: str, ranks: Ranks, alive: Callable[[str], bool]) -> None:
        """Refuse a snapshot of ``tag`` in ``folder`` from a client of a one-rank job while another client holds
        uncommitted snapshots of that tag there, as ``check_owner`` holds files: the two saves' files would meet
        under one marker, so one commit would list a mix of both, or each save refuse a file of the other's and
        neither commit (two DCP saves of one checkpoint_id at once, each file of its own). The ranks of one job
        share their tags: their commit gathers them. A gone client holds nothing but a commit under way."""
        if ranks.world_size > 1:
            return
        for table in (self._open, self._committing, self._failed):
            for (other, held), jobs in list(table.items()):
                if other == client_id or held != tag or not any(j.folder == folder for j in jobs):
                    continue
                if table is self._committing or alive(other):
                    raise PathNotAllowedError(f"tag {tag!r} refused in {folder}: client {other} is saving it there, "
                                              "not yet committed; two clients must not save one tag at once",
                                              path=folder)

    def committing(self, client_id: str, tag: str, folder: str) -> bool:
        """Whether this client's commit of ``tag`` with files in ``folder`` is in flight: its marker may land at any
        moment, so the client's new save of the tag must be written as a new version, never renamed over a file
        that marker lists. Other ranks' saves of a tag whose commit waits for them join it, as they should."""
        jobs = self._committing.get((client_id, tag), [])
        return any(within(j.path, folder) for j in jobs)

    def add(self, job: AdmittedSnapshot, ranks: Ranks) -> None:
        self._open.setdefault((job.client_id, job.tag), []).append(job)
        if ranks.world_size > 1:
            job.durable.add_done_callback(functools.partial(self._snapshot_done, ranks, job))

    def _snapshot_done(self, ranks: Ranks, job: AdmittedSnapshot, durable: asyncio.Future) -> None:
        if not durable.cancelled() and durable.exception() is not None:
            self._fail_round(ranks, job.tag, f"its snapshot of {job.path} failed: {durable.exception()}")

    def skip(self, client_id: str, tag: str, reason: str) -> None:
        """Remember why ``tag`` was skipped, so its commit says so instead of 'nothing to commit'."""
        _remember(self._skipped, (client_id, tag), reason)

    def refuse(self, client_id: str, tag: str, reason: str, ranks: Ranks) -> None:
        """A snapshot of ``tag`` was refused, or part of it lost (``reason`` says which): its commit fails, naming
        why, instead of committing the others; and so does every other rank's commit of the tag, at once."""
        _remember(self._refused, (client_id, tag), reason)
        self._fail_round(ranks, tag, reason)

    def _fail_round(self, ranks: Ranks, tag: str, why: str) -> None:
        """Rank ``ranks.rank``'s snapshot of ``tag`` was refused or failed before it committed the tag: the tag's
        round on this node fails now, for the ranks waiting in it and those yet to commit it, not at commit_timeout.

        A rank that committed the round already failed in a snapshot of its next one: its own
        commit of that one says so.
        """
        if ranks.world_size == 1:
            return
        key = (ranks.job, ranks.world_size, tag)
        group = self._groups.get(key)
        if group is not None and ranks.rank in group.committed:
            if not group.done.done():
                return
            group = None  # a round that failed, and told this rank: this snapshot is of the next one
        if group is None:
            group = self._start(key, ranks, time.time_ns())
        group.fail(CommitError(f"tag {tag!r} not committed: rank {ranks.rank}: {why}", tag=tag))

    def _start(self, key: tuple[str, int, str], ranks: Ranks, requested_ns: int) -> _TagGroup:
        """A new round of the tag on this node, in place of the last one (failed, or none)."""
        group = self._groups[key] = _TagGroup.start(ranks, requested_ns)
        for stale in [k for k, g in self._groups.items() if g.failed][:-HISTORY]:  # ranks that never committed them
            del self._groups[stale]
        return group

    def _abstain(self, ranks: Ranks, tag: str, exc: DatastatesError) -> None:
        """Rank ``ranks.rank``'s commit of ``tag`` fails before it joins the node's round (its snapshot was refused,
        or skipped): the round it owes fails with it now, for the ranks waiting in it, not at commit_timeout."""
        if ranks.world_size == 1:
            return
        key = (ranks.job, ranks.world_size, tag)
        group = self._groups.get(key)
        if group is not None and ranks.rank not in group.committed:
            group.fail(CommitError(f"tag {tag!r} not committed: rank {ranks.rank}'s commit of it failed: {exc.message}",
                                   tag=tag))
            self._told(key, group, ranks.rank)

    def commit_states(self) -> dict[int, str]:
        """Per snapshot id, where its tag's commit stands: ``open`` (not asked yet), ``committing`` (asked, not yet
        answered) or ``failed`` (answered with a failure, kept for a retry); absent once committed or dropped."""
        tables = (("open", self._open), ("committing", self._committing), ("failed", self._failed))
        return {job.id: state for state, table in tables for jobs in table.values() for job in jobs}

    def skipped(self, client_id: str, tag: str) -> str:
        return self._skipped.get((client_id, tag), "")

    def forget(self, client_id: str) -> set[str]:
        """A client that leaves without committing leaves no tag half-open behind: its new versions' staging goes too.
        Returns the tags it had snapshotted and not committed."""
        opened = {tag for owner, tag in self._open if owner == client_id}
        for table in (self._open, self._failed, self._skipped, self._refused):
            for key in [k for k in table if k[0] == client_id]:
                jobs = table.pop(key)
                if table is self._open or table is self._failed:  # by identity: an emptied table equals another
                    self._versions.abandon([j.path for j in jobs])
        return opened

    def died(self, client_id: str) -> None:
        """A client gone without BYE (killed, or silent past liveness): the rounds it asked to commit have one rank
        fewer to tell; a node other than 0 takes its part of a round back once none is left (daemon/gather.py). A
        client that said BYE left on purpose: its commit stands."""
        for group in self._groups.values():
            group.clients.discard(client_id)

    def rank_lost(self, ranks: Ranks, opened: set[str], peers: set[str]) -> None:
        """A rank gone without committing fails the tags it was still owed to, at once instead of at commit_timeout:
        the rounds under way, those of the tags it had snapshotted (``opened``) that no rank asked to commit yet, and
        those its job's other clients here (``peers``) snapshotted or asked to commit but whose round has not begun
        (a COMMIT still waiting for its sequence when the rank went would otherwise start a round that waits for it)."""
        owed = opened | {tag for table in (self._open, self._committing) for owner, tag in table if owner in peers}
        for tag in owed:
            if (ranks.job, ranks.world_size, tag) not in self._groups:
                self._start((ranks.job, ranks.world_size, tag), ranks, time.time_ns())
        for key, group in list(self._groups.items()):
            if key[:2] == (ranks.job, ranks.world_size) and ranks.rank not in group.committed:
                group.fail(CommitError(f"tag {key[2]!r} not committed: rank {ranks.rank} is gone without committing it",
                                       tag=key[2]))
                self._told(key, group, ranks.rank)  # its restart's commit of the tag is of the next round

    def _told(self, key: tuple[str, int, str], group: _TagGroup, rank: int) -> None:
        """``rank`` was told that ``group``'s round failed: the group goes once every rank of the node was."""
        group.committed.add(rank)
        if len(group.committed) >= group.ranks.local_world_size and self._groups.get(key) is group:
            del self._groups[key]

    def groups(self) -> list[dict[str, Any]]:
        """Multi-rank tags waiting for ranks or nodes, for ``status``."""
        return [{"tag": tag, "job": job, "committed_ranks": sorted(g.committed), "local_ranks": g.ranks.local_world_size,
                 "nodes": g.ranks.num_nodes} for (job, _, tag), g in self._groups.items() if not g.failed]

    async def commit(self, client_id: str, tag: str, ranks: Ranks, began_ns: int = 0) -> m.Committed:
        """Commit ``tag`` for this client; ``began_ns``: when its process started (``ClientRecord.began_ns``)."""
        key = (client_id, tag)
        skipped, refused = self._skipped.pop(key, ""), self._refused.pop(key, "")
        if skipped or refused:  # none of the tag's snapshots will ever be committed
            await self._drop(self._open.pop(key, []) + self._failed.pop(key, []), set())
            exc = (SnapshotSkippedError(f"tag {tag!r} not committed: it was skipped ({skipped})", tag=tag) if skipped
                   else CommitError(f"tag {tag!r} not committed: {refused}", tag=tag))
            self._abstain(ranks, tag, exc)
            raise exc
        jobs = self._committing[key] = self._open.pop(key, None) or []
        if ranks.world_size == 1:  # before any await: a snapshot admitted next gets its own version
            self._versions.seal([j.path for j in jobs])
        requested_ns = time.time_ns()
        self.pending += 1
        try:
            jobs = self._committing[key] = await self._supersede(client_id, tag, jobs)
            if ranks.world_size == 1:
                self._versions.seal([j.path for j in jobs])  # a retry's
            sequence = await self._next_sequence(tag, jobs, ranks)
            if ranks.world_size == 1:
                return await self._commit_alone(client_id, tag, jobs, requested_ns, sequence)
            return await self._commit_rank(client_id, tag, ranks, jobs, requested_ns, sequence, began_ns)
        finally:
            self.pending -= 1
            if self._committing.get(key) is jobs:  # answered: committed (its marker lists them) or kept for a retry
                del self._committing[key]

    async def _supersede(self, client_id: str, tag: str, jobs: list[AdmittedSnapshot]) -> list[AdmittedSnapshot]:
        """The snapshots a commit covers: the new ones of its tag, else those of its last failed commit (a retry).

        Never both: a tag is one point of the trainer's program, so a save after a failed
        commit replaces that commit's snapshots instead of joining them. Their files that
        the new save does not write again are deleted, so no stale file of another step is
        left under a final name in the tag's folder.
        """
        failed = self._failed.pop((client_id, tag), [])
        if not jobs:
            return failed
        await self._drop(failed, {j.path for j in jobs})
        return jobs

    async def _drop(self, jobs: list[AdmittedSnapshot], keep: set[str]) -> None:
        """Snapshots that will never be committed: once each has finished, delete its file unless in ``keep``."""
        await asyncio.gather(*(j.durable for j in jobs), return_exceptions=True)
        stale = [j.path for j in jobs if j.path not in keep]
        if stale:
            await self._engine.flush(_remove_uncommitted, stale, self._roots)
            self._versions.abandon(stale)  # a new version never to be committed goes whole

    async def _next_sequence(self, tag: str, jobs: list[AdmittedSnapshot], ranks: Ranks) -> int:
        """The commit's place in its run, in the order COMMITs arrive (0 when it names no file, or none is needed).

        It costs a read of every committed marker of the run, so it is read where it is used
        only: by the first rank of a node's round (the round's sequence is its), and not on a
        node other than node 0 of a shared folder (node 0's marker carries node 0's).
        """
        if not jobs or self._round_has_sequence(tag, ranks):
            return 0
        try:
            folder = tag_folder(tag, {j.path: 0 for j in jobs}, self._roots)
        except CommitError:
            return 0  # refused when the marker is placed
        if ranks.num_nodes > 1 and ranks.node_rank != 0 and self._storage.shared(folder):
            return 0
        run = os.path.dirname(folder)
        async with self._sequence_lock:  # FIFO: sequences follow the order the requests came in
            if self._round_has_sequence(tag, ranks):  # a rank ahead in this queue began the round meanwhile
                return 0
            # read again each time: another writer of this run (a trainer saving on its own after it lost this
            # daemon, another daemon after a restart) may have committed since, with a higher sequence
            on_disk = await self._engine.flush(next_sequence, run)
            self._sequences[run] = max(self._sequences.get(run, 0) + 1, on_disk)
            return self._sequences[run]

    def _round_has_sequence(self, tag: str, ranks: Ranks) -> bool:
        group = self._groups.get((ranks.job, ranks.world_size, tag)) if ranks.world_size > 1 else None
        return group is not None and bool(group.sequence) and not group.failed

    async def _durable(self, tag: str, jobs: list[AdmittedSnapshot]) -> dict[str, int]:
        """The files of ``jobs`` once all are durable (path → size); CommitError if one failed."""
        results = await asyncio.gather(*(j.durable for j in jobs), return_exceptions=True)
        failed = [(j, r) for j, r in zip(jobs, results) if isinstance(r, BaseException)]
        for job in jobs:
            try:
                job.check_still_wanted()
            except SnapshotFailedError as exc:
                failed.append((job, exc))
        if failed:  # such a commit is never retried: a new version staged for it is removed whole now
            self._versions.abandon([j.path for j in jobs])
            job, exc = failed[0]
            raise CommitError(
                f"tag {tag!r} not committed: {len(failed)} of its {len(jobs)} snapshot(s) failed; first: {job.path}: {exc}",
                tag=tag,
            )
        return {j.path: j.file_size for j in jobs}

    async def _commit_alone(self, client_id: str, tag: str, jobs: list[AdmittedSnapshot], requested_ns: int,
                            sequence: int) -> m.Committed:
        if not jobs:
            raise CommitError(f"nothing to commit for tag {tag!r}: this client has no uncommitted snapshot with it", tag=tag)
        files = await self._durable(tag, jobs)
        try:
            return await self._first_commit(CommitEvent(client_id, tag, files, Ranks(), requested_ns, max(j.id for j in jobs),
                                                        sequence, {j.path: j.snapshot for j in jobs},
                                                        wanted=functools.partial(_still_wanted, jobs)))
        except CommitError:
            self._failed[(client_id, tag)] = jobs  # a retry may succeed
            raise

    async def _commit_rank(
        self, client_id: str, tag: str, ranks: Ranks, jobs: list[AdmittedSnapshot], requested_ns: int, sequence: int,
        began_ns: int,
    ) -> m.Committed:
        """One rank's share; the node's last rank to arrive finishes the tag for all of them.

        A rank not yet told of the node's failed round is handed its failure, even one whose snapshots came after it
        failed: nothing tells them from that round's step (a rank's save can follow another rank's failure), so it
        gets a false failure rather than a marker that lists two steps.
        """
        key = (ranks.job, ranks.world_size, tag)
        group = self._groups.get(key)
        if group is not None and group.failed and ranks.rank in group.committed:
            group = None  # that round failed and told this rank: this commit is of the next one
        if group is None:
            group = self._start(key, ranks, requested_ns)
        if ranks.rank in group.committed:
            raise CommitError(f"rank {ranks.rank} already committed tag {tag!r}", tag=tag)
        group.sequence = group.sequence or sequence  # the first rank to ask, unless it named no file
        group.committed.add(ranks.rank)
        group.paths.update(j.path for j in jobs)
        if len(group.committed) == ranks.local_world_size:
            self._versions.seal(sorted(group.paths))  # the node's last rank is in: a later snapshot is a new version
        group.clients.add(client_id)
        if began_ns:
            group.began_ns = min(group.began_ns or began_ns, began_ns)
        if not group.failed:
            try:
                group.files.update(await self._durable(tag, jobs))
                group.snapshots.update({j.path: j.snapshot for j in jobs})
                group.order = max([group.order, *(j.id for j in jobs)])
            except CommitError as exc:
                group.fail(exc)
        if group.failed:  # a rank's snapshot was refused or failed: every rank is told at once
            self._told(key, group, ranks.rank)
        else:
            group.durable += 1
            if group.durable == ranks.local_world_size:
                try:
                    group.done.set_result(await self._finish(client_id, tag, group))
                except DatastatesError as exc:
                    group.done.set_exception(exc if isinstance(exc, CommitError) else CommitError(
                        f"tag {tag!r} not committed: {exc.message}", tag=tag))
                finally:
                    if self._groups.get(key) is group:
                        del self._groups[key]
            try:
                return await asyncio.wait_for(asyncio.shield(group.done), self._timeout)
            except TimeoutError:
                missing = sorted(set(range(ranks.world_size)) - group.committed)
                exc = CommitError(
                    f"tag {tag!r} not committed: {ranks.local_world_size - len(group.committed)} rank(s) of this node "
                    f"did not commit within {self._timeout:.0f} s (committed: {sorted(group.committed)}; "
                    f"not yet: {missing[:16]})", tag=tag,
                )
                if len(group.committed) >= ranks.local_world_size:  # its last rank is finishing it: that may still land
                    raise exc from None
                group.fail(exc)  # the round ends here: a later commit never joins it
            except DatastatesError:
                if group.durable == ranks.local_world_size:  # its commit failed: what it wrote is left as it is
                    raise
        await self._drop(jobs, set())  # the round failed before its commit: no file, nor staged version, left of them
        return await group.done

    async def _finish(self, client_id: str, tag: str, group: _TagGroup) -> m.Committed:
        if not group.files:
            raise CommitError(f"tag {tag!r} not committed: no rank of this node snapshotted a file for it", tag=tag)
        return await self._first_commit(CommitEvent(client_id, tag, group.files, group.ranks, group.requested_ns,
                                                    group.order, group.sequence, group.snapshots,
                                                    began_ns=group.began_ns, present=lambda: bool(group.clients)))

    async def _first_commit(self, commit: CommitEvent) -> m.Committed:
        """The commit a client asked for, on the tier its files were written to, then announced."""
        staging = self._versions.staged(commit.tag, commit.files)
        committed, sequence = await self._settle(commit)
        commit = dataclasses.replace(commit, sequence=sequence)  # a node other than 0 did not read it (_next_sequence)
        if staging is not None:  # the new version is in place: its files are where the old ones were
            commit = commit.moved(staging.visible)
        for listener in self._listeners:
            listener.committed(commit)
        return committed

    async def settle(self, commit: CommitEvent) -> m.Committed:
        """Commit this node's durable files as the tag where they lie: a first commit, or a tier transfer's.

        One node, or a tier only this node sees: this node's marker. Several nodes on a
        shared folder: each writes a done marker, node 0 gathers them and writes the tag's.
        """
        return (await self._settle(commit))[0]

    async def _settle(self, commit: CommitEvent) -> tuple[m.Committed, int]:
        """``settle``, and the sequence the tag got: node 0's, where node 0 wrote its marker."""
        client_id, tag, files, ranks, requested_ns, sequence = (
            commit.client_id, commit.tag, commit.files, commit.ranks, commit.requested_ns, commit.sequence)
        order = (sequence, commit.order)
        nodes = ranks.num_nodes
        staging = self._versions.staged(tag, files) if nodes == 1 else None
        if staging is not None:  # a new version of a committed tag: marker beside its files, then switched in
            marker = make_marker(tag, files, staging.staging, requested_ns, sequence, snapshots=commit.snapshots)
            return await self._publish(client_id, tag, marker, staging.folder, order, staging, commit.wanted), sequence
        folder = tag_folder(tag, files, self._roots)
        if nodes == 1 or not self._storage.shared(folder):
            marker = make_marker(tag, files, folder, requested_ns, sequence, nodes, -1 if nodes == 1 else ranks.node_rank,
                                 commit.snapshots, ranks.job)
            return await self._publish(client_id, tag, marker, folder, order, wanted=commit.wanted), sequence
        if os.path.basename(folder) != tag:
            raise CommitError(f"tag {tag!r}: in a multi-node job a tag's files must live under a folder named {tag!r}", tag=tag)
        mine = make_marker(tag, files, folder, requested_ns, sequence, nodes, ranks.node_rank, commit.snapshots,
                           ranks.job, self._owner, commit.began_ns)
        await self._write(os.path.join(folder, done_name(tag, ranks.node_rank)), mine.encode(), tag)
        if ranks.node_rank != 0:
            marker = await self._nodes.await_marker(tag, folder, mine, commit.present)
            return m.Committed(tag=tag, marker=os.path.join(folder, marker_name(tag)), files=tag_files(folder, marker)), \
                marker.sequence
        everyone, snapshots = await self._nodes.gather(tag, folder, nodes, Attempt(ranks.job, commit.began_ns, requested_ns),
                                                       commit.present)
        committed = await self._publish(client_id, tag, make_marker(tag, everyone, folder, requested_ns, sequence, nodes,
                                                                    snapshots=snapshots), folder, order,
                                        wanted=functools.partial(still_reported, tag, folder, nodes))
        await self._nodes.tidy(tag, folder, nodes)
        return committed, sequence

    async def _publish(self, client_id: str, tag: str, marker: CommitMarker, folder: str, order: tuple[int, int],
                       staging: NewVersion | None = None, wanted: Callable[[], None] | None = None) -> m.Committed:
        """The tag's marker, then the trackers: a tracker never names a tag before its marker exists.

        With ``staging``, the marker goes beside the new version's files, and the version is
        switched in place of the committed one in one step (daemon/versions.py).
        """
        path = os.path.join(folder, marker_name(tag))
        if staging is None:
            await self._write(path, marker.encode(), tag, check=functools.partial(check_listed, folder, marker, wanted))
        else:
            await self._write(os.path.join(staging.staging, marker_name(tag)), marker.encode(), tag)
            await self._engine.flush(self._versions.switch, staging, functools.partial(_ask, wanted, tag))
        parent = os.path.dirname(folder)
        if os.path.basename(folder) == tag and any(within(parent, r) for r in self._roots):
            async with self._tracker_lock:  # one tracker write at a time, so renames land in order
                for tracker, data in trackers(tag, folder).items():
                    if order >= self._tracked.get(tracker, (-1, -1)):
                        self._tracked[tracker] = order
                        await self._write(tracker, data, tag)
            keep_last = self._storage.keep_last_at(parent)
            if keep_last is not None:
                await self._prune(parent, keep_last)
        files = tag_files(folder, marker)
        self.committed.append({"tag": tag, "client": client_id, "marker": path, "files": len(files),
                               "committed_ns": marker.committed_ns})
        return m.Committed(tag=tag, marker=path, files=files)

    async def _prune(self, parent: str, keep_last: int) -> None:
        """Retention after a commit; a tag that cannot be deleted is logged, and the commit stands."""
        try:
            gone = await self._engine.flush(prune, parent, keep_last, self.open_tags())
        except OSError as exc:
            log.warning("keep_last: pruning %s failed: %s", parent, exc)
            return
        for listener in self._listeners:
            listener.pruned(gone)

    def open_tags(self) -> set[str]:
        """Tags with snapshots not yet committed (being saved again), or held by a listener (a tier transfer): never pruned."""
        held = {tag for _, tag in self._open} | {tag for (_, _, tag), g in self._groups.items() if not g.failed}
        return held.union(*(listener.holds() for listener in self._listeners))

    async def _write(self, path: str, data: bytes, tag: str, check: Callable[[int], None] | None = None) -> None:
        try:
            await self._engine.flush(self._engine.writer(path).publish, path, data, check)
        except StorageError as exc:
            raise CommitError(f"tag {tag!r} not committed: {exc.message}", tag=tag) from None


def check_listed(folder: str, marker: CommitMarker, wanted: Callable[[], None] | None, folder_fd: int) -> None:
    """Every file ``marker`` lists is in ``folder`` with its size and snapshot, right before the marker is renamed
    in: a file moved away meanwhile (another tag's new version switched in over a shared folder), or replaced by
    another writer (a trainer saving the same path on its own), fails the commit instead.

    Asked through the descriptor the marker is renamed into (``folder_fd``), so a folder
    renamed meanwhile (by another user, in a folder they may write) takes the files and the
    marker along together, never one without the other. ``wanted`` (CommitEvent.wanted)
    is asked first, in the same call: a trainer that went local writes these paths itself.
    """
    _ask(wanted, marker.tag)
    why = unlisted(folder, marker, folder_fd, identity=True)
    if why:
        raise CommitError(f"tag {marker.tag!r} not committed: {why}", tag=marker.tag)


def _still_wanted(jobs: list[AdmittedSnapshot]) -> None:
    for job in jobs:
        job.check_still_wanted()


def _ask(wanted: Callable[[], None] | None, tag: str) -> None:
    """``wanted()``, its refusal as the commit's."""
    if wanted is None:
        return
    try:
        wanted()
    except SnapshotFailedError as exc:
        raise CommitError(f"tag {tag!r} not committed: {exc.message}", tag=tag) from None


def _remember(table: collections.OrderedDict[tuple[str, str], str], key: tuple[str, str], reason: str) -> None:
    table[key] = reason
    while len(table) > HISTORY:
        table.popitem(last=False)


def _remove_uncommitted(paths: list[str], roots: Sequence[str]) -> None:
    """Delete the files of superseded snapshots, unless a committed marker lists one (then it is not theirs):
    any marker within ``roots``, whatever its folder's trust (``listing``)."""
    for path in paths:
        if not listing(path, roots=roots):
            _unlink(path)


def _unlink(path: str) -> None:
    """Remove ``path`` through its folder's descriptor, reached without following a link (protocol/fileio.py)."""
    try:
        remove(path)
    except (FileNotFoundError, NotADirectoryError):  # no file there: its folder is gone, or is a file (a failed save's)
        pass
