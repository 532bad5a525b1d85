"""Commit: a tag becomes committed when all its files are durable and its marker is in place.

The marker lists every file of the tag with its size; it is written under a temporary
name, fsynced and renamed into the tag's folder. Readers trust nothing else
(client/reader.py). A job of one client commits its own files. In a job of many ranks
the daemon gathers its node's ranks first; across nodes the daemons never talk, they
meet on the shared file system, as DLRover's done-files and DCP's metadata-last rename
do: each node writes a durable done marker of its files, node 0 waits for all of them
and then writes the tag's marker and the ``latest`` trackers, and the other nodes wait
for that marker. A node that never reports leaves the tag uncommitted.

The ledger's parts each have a module: a node's ranks gathered per tag (daemon/rounds.py),
the run's commit order (daemon/run_order.py), the trackers (daemon/trackers.py), and
retention after a commit (daemon/keep_last.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

from datastates.protocol import messages as m
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import (
    CommitError,
    PathNotAllowedError,
    SnapshotFailedError,
    SnapshotSkippedError,
    StorageError,
)
from datastates.protocol.fileio import remove
from datastates.protocol.format import CommitMarker, MarkerFile, done_name, marker_name
from datastates.protocol.version import COMMIT_VERSION

from datastates.protocol.paths import within
from datastates.protocol.tags import file_commits, tag_files, unlisted

from .config import HISTORY, StorageConfig
from .engine import Engine
from .events import CommitEvent, CommitListener
from .gather import Attempt, NodeGather, still_reported
from .keep_last import KeepLast
from .rounds import RankRound, RankRounds
from .run_order import RunOrder
from .snapshot import AdmittedSnapshot
from .trackers import Trackers
from .resave import NewVersion, Versions


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


class CommitLedger:
    """The snapshots not yet committed, by client and tag, and the commits of them: marker, trackers, retention."""

    def __init__(self, engine: Engine, storage: StorageConfig, timeout: float, versions: Versions, owner: str) -> None:
        self._engine = engine
        self._owner = owner
        self._versions = versions
        self._storage = storage
        self._roots = storage.roots
        self._nodes = NodeGather(engine, timeout)
        self._rounds = RankRounds(versions, timeout, self._durable, self._finish, self._drop)
        self._order = RunOrder(engine, storage, functools.partial(tag_folder, roots=self._roots))
        self._trackers = Trackers()
        self._listeners: list[CommitListener] = []
        self._keep_last = KeepLast(engine, storage, self._listeners, self._held)
        self._open: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        self._committing: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        """Snapshots whose COMMIT is under way, until it is answered."""
        self._failed: dict[tuple[str, str], list[AdmittedSnapshot]] = {}
        """Snapshots of a commit that failed: a commit with no new snapshot of the tag retries them (see ``commit``)."""
        self._skipped: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        self._refused: collections.OrderedDict[tuple[str, str], str] = collections.OrderedDict()
        """Tags one of whose snapshots was refused at admission, or part of which went with a daemon the client lost
        (COMMIT ``lost``): committing the rest would make a partial tag. → why, as the commit's error says it."""
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
            for (other, held), admitted in list(table.items()):
                if not any(s.path == path for s in admitted):
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
            for (other, held), admitted in list(table.items()):
                if other == client_id or held != tag or not any(s.folder == folder for s in admitted):
                    continue
                if table is self._committing or alive(other):
                    raise PathNotAllowedError(f"tag {tag!r} refused in {folder}: client {other} is saving it there, "
                                              "not yet committed; two clients must not save one tag at once",
                                              path=folder)

    def committing(self, client_id: str, tag: str, folder: str) -> bool:
        """Whether this client's commit of ``tag`` with files in ``folder`` is in flight: its marker may land at any
        moment, so the client's new save of the tag must be written as a new version, never renamed over a file
        that marker lists. Other ranks' saves of a tag whose commit waits for them join it, as they should."""
        admitted = self._committing.get((client_id, tag), [])
        return any(within(s.path, folder) for s in admitted)

    def add(self, snapshot: AdmittedSnapshot, ranks: Ranks) -> None:
        self._open.setdefault((snapshot.client_id, snapshot.tag), []).append(snapshot)
        if ranks.world_size > 1:
            snapshot.durable.add_done_callback(functools.partial(self._snapshot_done, ranks, snapshot))

    def _snapshot_done(self, ranks: Ranks, snapshot: AdmittedSnapshot, durable: asyncio.Future) -> None:
        if not durable.cancelled() and durable.exception() is not None:
            self._rounds.fail(ranks, snapshot.tag, f"its snapshot of {snapshot.path} failed: {durable.exception()}")

    def skip(self, client_id: str, tag: str, reason: str) -> None:
        """Remember why ``tag`` was skipped, so its commit says so instead of 'nothing to commit'."""
        _remember(self._skipped, (client_id, tag), reason)

    def refuse(self, client_id: str, tag: str, reason: str, ranks: Ranks) -> None:
        """A snapshot of ``tag`` was refused, or part of it lost (``reason`` says which): its commit fails, naming
        why, instead of committing the others; and so does every other rank's commit of the tag, at once."""
        _remember(self._refused, (client_id, tag), reason)
        self._rounds.fail(ranks, tag, reason)

    def commit_states(self) -> dict[int, str]:
        """Per snapshot id, where its tag's commit stands: ``open`` (not asked yet), ``committing`` (asked, not yet
        answered) or ``failed`` (answered with a failure, kept for a retry); absent once committed or dropped."""
        tables = (("open", self._open), ("committing", self._committing), ("failed", self._failed))
        return {s.id: state for state, table in tables for admitted in table.values() for s in admitted}

    def skipped(self, client_id: str, tag: str) -> str:
        return self._skipped.get((client_id, tag), "")

    def forget(self, client_id: str) -> set[str]:
        """A client that leaves without committing leaves no tag half-open behind: its new versions' staging goes too.
        Returns the tags it had snapshotted and not committed."""
        opened = {tag for owner, tag in self._open if owner == client_id}
        for table in (self._open, self._failed, self._skipped, self._refused):
            for key in [k for k in table if k[0] == client_id]:
                admitted = table.pop(key)
                if table is self._open or table is self._failed:  # by identity: an emptied table equals another
                    self._versions.abandon([s.path for s in admitted])
        return opened

    def died(self, client_id: str) -> None:
        """A client gone without BYE (killed, or silent past liveness): the rounds it asked to commit have one rank
        fewer to tell; a node other than 0 takes its part of a round back once none is left (daemon/gather.py). A
        client that said BYE left on purpose: its commit stands."""
        self._rounds.died(client_id)

    def rank_lost(self, ranks: Ranks, opened: set[str], peers: set[str]) -> None:
        """A rank gone without committing fails, at once, the tags it owed: those it had snapshotted (``opened``),
        and those its job's other clients here (``peers``) snapshotted or asked to commit (``RankRounds.rank_lost``)."""
        owed = opened | {tag for table in (self._open, self._committing) for owner, tag in table if owner in peers}
        self._rounds.rank_lost(ranks, owed)

    def groups(self) -> list[dict[str, Any]]:
        """Multi-rank tags waiting for ranks or nodes, for ``status``."""
        return self._rounds.status()

    async def commit(self, client_id: str, tag: str, ranks: Ranks, began_ns: int = 0) -> m.Committed:
        """Commit ``tag`` for this client; ``began_ns``: when its process started (``ClientRecord.began_ns``)."""
        key = (client_id, tag)
        skipped, refused = self._skipped.pop(key, ""), self._refused.pop(key, "")
        if skipped or refused:  # none of the tag's snapshots will ever be committed
            await self._drop(self._open.pop(key, []) + self._failed.pop(key, []), set())
            exc = (SnapshotSkippedError(f"tag {tag!r} not committed: it was skipped ({skipped})", tag=tag) if skipped
                   else CommitError(f"tag {tag!r} not committed: {refused}", tag=tag))
            self._rounds.abstain(ranks, tag, exc)
            raise exc
        admitted = self._committing[key] = self._open.pop(key, None) or []
        if ranks.world_size == 1:  # before any await: a snapshot admitted next gets its own version
            self._versions.seal([s.path for s in admitted])
        requested_ns = time.time_ns()
        self.pending += 1
        try:
            admitted = self._committing[key] = await self._supersede(client_id, tag, admitted)
            if ranks.world_size == 1:
                self._versions.seal([s.path for s in admitted])  # a retry's
            begun = functools.partial(self._rounds.has_sequence, tag, ranks)
            sequence = await self._order.next(tag, admitted, ranks, begun)
            if ranks.world_size == 1:
                return await self._commit_alone(client_id, tag, admitted, requested_ns, sequence)
            return await self._rounds.commit(client_id, tag, ranks, admitted, requested_ns, sequence, began_ns)
        finally:
            self.pending -= 1
            if self._committing.get(key) is admitted:  # answered: committed (its marker lists them) or kept for a retry
                del self._committing[key]

    async def _supersede(self, client_id: str, tag: str, admitted: list[AdmittedSnapshot]) -> list[AdmittedSnapshot]:
        """The snapshots a commit covers: the new ones of its tag, else those of its last failed commit (a retry).

        Never both: a tag is one point of the trainer's program, so a save after a failed
        commit replaces that commit's snapshots instead of joining them. Their files that
        the new save does not write again are deleted, so no stale file of another step is
        left under a final name in the tag's folder.
        """
        failed = self._failed.pop((client_id, tag), [])
        if not admitted:
            return failed
        await self._drop(failed, {s.path for s in admitted})
        return admitted

    async def _drop(self, admitted: list[AdmittedSnapshot], keep: set[str]) -> None:
        """Snapshots that will never be committed: once each has finished, delete its file unless in ``keep``."""
        await asyncio.gather(*(s.durable for s in admitted), return_exceptions=True)
        stale = [s.path for s in admitted if s.path not in keep]
        if stale:
            await self._engine.flush(_remove_uncommitted, stale, self._roots)
            self._versions.abandon(stale)  # a new version never to be committed goes whole

    async def _durable(self, tag: str, admitted: list[AdmittedSnapshot]) -> dict[str, int]:
        """The files of ``jobs`` once all are durable (path → size); CommitError if one failed."""
        results = await asyncio.gather(*(s.durable for s in admitted), return_exceptions=True)
        failed = [(s, r) for s, r in zip(admitted, results) if isinstance(r, BaseException)]
        for snapshot in admitted:
            try:
                snapshot.check_still_wanted()
            except SnapshotFailedError as exc:
                failed.append((snapshot, exc))
        if failed:  # such a commit is never retried: a new version staged for it is removed whole now
            self._versions.abandon([s.path for s in admitted])
            snapshot, exc = failed[0]
            raise CommitError(
                f"tag {tag!r} not committed: {len(failed)} of its {len(admitted)} snapshot(s) failed; first: {snapshot.path}: {exc}",
                tag=tag,
            )
        return {s.path: s.file_size for s in admitted}

    async def _commit_alone(self, client_id: str, tag: str, admitted: list[AdmittedSnapshot], requested_ns: int,
                            sequence: int) -> m.Committed:
        if not admitted:
            raise CommitError(f"nothing to commit for tag {tag!r}: this client has no uncommitted snapshot with it", tag=tag)
        files = await self._durable(tag, admitted)
        try:
            return await self._first_commit(CommitEvent(client_id, tag, files, Ranks(), requested_ns, max(s.id for s in admitted),
                                                        sequence, {s.path: s.snapshot for s in admitted},
                                                        wanted=functools.partial(_still_wanted, admitted)))
        except CommitError:
            self._failed[(client_id, tag)] = admitted  # a retry may succeed
            raise

    async def _finish(self, client_id: str, tag: str, group: RankRound) -> m.Committed:
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
        switched in place of the committed one in one step (daemon/resave.py).
        """
        path = os.path.join(folder, marker_name(tag))
        if staging is None:
            await self._write(path, marker.encode(), tag, check=functools.partial(check_listed, folder, marker, wanted))
        else:
            await self._write(os.path.join(staging.staging, marker_name(tag)), marker.encode(), tag)
            await self._engine.flush(self._versions.switch, staging, functools.partial(_ask, wanted, tag))
        parent = os.path.dirname(folder)
        if os.path.basename(folder) == tag and any(within(parent, r) for r in self._roots):
            await self._trackers.advance(tag, folder, order, functools.partial(self._write, tag=tag))
            await self._keep_last.after_commit(parent)
        files = tag_files(folder, marker)
        self.committed.append({"tag": tag, "client": client_id, "marker": path, "files": len(files),
                               "committed_ns": marker.committed_ns})
        return m.Committed(tag=tag, marker=path, files=files)

    def _held(self) -> set[str]:
        """Tags with snapshots not yet committed (being saved again): retention never deletes them."""
        return {tag for _, tag in self._open} | self._rounds.held()

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


def _still_wanted(admitted: list[AdmittedSnapshot]) -> None:
    for snapshot in admitted:
        snapshot.check_still_wanted()


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
    any marker within ``roots``, whatever its folder's trust (``file_commits``)."""
    for path in paths:
        if not file_commits(path, roots=roots):
            _unlink(path)


def _unlink(path: str) -> None:
    """Remove ``path`` through its folder's descriptor, reached without following a link (protocol/fileio.py)."""
    try:
        remove(path)
    except (FileNotFoundError, NotADirectoryError):  # no file there: its folder is gone, or is a file (a failed save's)
        pass
