"""A multi-rank job's rounds on this node: a tag commits once every local rank asked, and fails for all at once.

Each tag of each job has one round here. A rank's COMMIT joins it; the node's last rank
to arrive finishes the tag for all of them (its marker, or its done marker for node 0 of
a shared folder: daemon/gather.py), and every rank waiting is answered alike. A rank
whose snapshot was refused or failed, or that is gone without committing, fails the
round at once for the others, not at commit_timeout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from datastates.protocol import messages as m
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import CommitError, DatastatesError

from .config import HISTORY
from .snapshot import AdmittedSnapshot
from .resave import Versions

RoundKey = tuple[str, int, str]
"""(training job, world size, tag): one round of one tag on this node."""


@dataclass
class RankRound:
    """One tag of one multi-rank job on this node, while its local ranks commit."""

    ranks: Ranks
    done: asyncio.Future
    requested_ns: int
    """When the node's first rank asked to commit the tag: ranks commit tags in order, so rounds are created in order."""
    committed: set[int] = field(default_factory=set)
    """Ranks whose COMMIT arrived."""
    durable: int = 0
    """Of those, how many have all their files durable: the one that makes it local_world_size finishes."""
    files: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, str] = field(default_factory=dict)
    order: int = 0
    """The newest snapshot id among the node's files (``CommitEvent.order``)."""
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
    def start(cls, ranks: Ranks, requested_ns: int) -> RankRound:
        done = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())
        return cls(ranks=ranks, done=done, requested_ns=requested_ns)

    @property
    def failed(self) -> bool:
        """It failed, and waits only to tell the node's ranks still to commit it (see ``RankRounds.fail``)."""
        return self.done.done() and not self.done.cancelled() and self.done.exception() is not None

    def fail(self, exc: CommitError) -> None:
        """The round fails with ``exc``, unless it ended already."""
        if not self.done.done():
            self.done.set_exception(exc)


Durable = Callable[[str, list[AdmittedSnapshot]], Awaitable[dict[str, int]]]
"""(tag, snapshots) → their files once durable (path → size); CommitError if one failed."""
Finish = Callable[[str, str, RankRound], Awaitable[m.Committed]]
"""(client id, tag, round) → the tag committed with the node's files."""
Drop = Callable[[list[AdmittedSnapshot], set[str]], Awaitable[None]]
"""Snapshots never to be committed: their files deleted, but those in the set."""


class RankRounds:
    """The rounds of this node's multi-rank jobs, by (job, world size, tag)."""

    def __init__(self, versions: Versions, timeout: float, durable: Durable, finish: Finish, drop: Drop) -> None:
        self._versions = versions
        self._timeout = timeout
        self._durable = durable
        self._finish = finish
        self._drop = drop
        self._groups: dict[RoundKey, RankRound] = {}

    def fail(self, ranks: Ranks, tag: str, why: str) -> None:
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

    def _start(self, key: RoundKey, ranks: Ranks, requested_ns: int) -> RankRound:
        """A new round of the tag on this node, in place of the last one (failed, or none)."""
        group = self._groups[key] = RankRound.start(ranks, requested_ns)
        for stale in [k for k, g in self._groups.items() if g.failed][:-HISTORY]:  # ranks that never committed them
            del self._groups[stale]
        return group

    def abstain(self, ranks: Ranks, tag: str, exc: DatastatesError) -> None:
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

    def died(self, client_id: str) -> None:
        """A client gone without BYE: the rounds it asked to commit have one rank fewer to tell (daemon/gather.py)."""
        for group in self._groups.values():
            group.clients.discard(client_id)

    def rank_lost(self, ranks: Ranks, owed: set[str]) -> None:
        """A rank gone without committing fails the tags it was still ``owed`` to, at once instead of at commit_timeout:
        the rounds under way, and those of the tags it or its job's other clients here had snapshotted or asked to
        commit but whose round has not begun (a COMMIT still waiting for its sequence when the rank went would
        otherwise start a round that waits for it)."""
        for tag in owed:
            if (ranks.job, ranks.world_size, tag) not in self._groups:
                self._start((ranks.job, ranks.world_size, tag), ranks, time.time_ns())
        for key, group in list(self._groups.items()):
            if key[:2] == (ranks.job, ranks.world_size) and ranks.rank not in group.committed:
                group.fail(CommitError(f"tag {key[2]!r} not committed: rank {ranks.rank} is gone without committing it",
                                       tag=key[2]))
                self._told(key, group, ranks.rank)  # its restart's commit of the tag is of the next round

    def _told(self, key: RoundKey, group: RankRound, rank: int) -> None:
        """``rank`` was told that ``group``'s round failed: the group goes once every rank of the node was."""
        group.committed.add(rank)
        if len(group.committed) >= group.ranks.local_world_size and self._groups.get(key) is group:
            del self._groups[key]

    def status(self) -> list[dict[str, Any]]:
        """Multi-rank tags waiting for ranks or nodes, for ``status``."""
        return [{"tag": tag, "job": job, "committed_ranks": sorted(g.committed), "local_ranks": g.ranks.local_world_size,
                 "nodes": g.ranks.num_nodes} for (job, _, tag), g in self._groups.items() if not g.failed]

    def held(self) -> set[str]:
        """Tags of the rounds under way: never pruned."""
        return {tag for (_, _, tag), g in self._groups.items() if not g.failed}

    def has_sequence(self, tag: str, ranks: Ranks) -> bool:
        """Whether the tag's round here already has its place in the run (its first rank's sequence)."""
        group = self._groups.get((ranks.job, ranks.world_size, tag)) if ranks.world_size > 1 else None
        return group is not None and bool(group.sequence) and not group.failed

    async def commit(
        self, client_id: str, tag: str, ranks: Ranks, admitted: list[AdmittedSnapshot], requested_ns: int, sequence: int,
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
        group.paths.update(s.path for s in admitted)
        if len(group.committed) == ranks.local_world_size:
            self._versions.seal(sorted(group.paths))  # the node's last rank is in: a later snapshot is a new version
        group.clients.add(client_id)
        if began_ns:
            group.began_ns = min(group.began_ns or began_ns, began_ns)
        if not group.failed:
            try:
                group.files.update(await self._durable(tag, admitted))
                group.snapshots.update({s.path: s.snapshot for s in admitted})
                group.order = max([group.order, *(s.id for s in admitted)])
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
        await self._drop(admitted, set())  # the round failed before its commit: no file, nor staged version, left of them
        return await group.done
