"""The nodes of one job meet in a tag's shared folder: node 0 gathers the done markers, the others await its marker.

Each node writes a durable done marker of its files (daemon/commit.py); node 0 waits for
every node's, then writes the tag's marker; the other nodes wait for that marker. All of
it goes through the shared file system, whose metadata server is what a large job runs
short of first (docs/scale.md), so every wait is frugal with it:

- node 0 lists the tag's folder once a look and opens only the done markers that have
  appeared, never one per missing node (up to ``FEW_MISSING`` missing, it opens those);
- the other nodes look for the one marker less often the more nodes there are, so that
  all of them together ask at most ``LOOKS_PER_S`` a second, however many wait;
- each wait starts short (a commit whose nodes are all done costs a look or two) and
  grows, so a node that is late by minutes costs a look a second, not a storm;
- node 0 removes the done markers through one descriptor of the folder.

A done marker counts only for the attempt of the job that wrote it (``Attempt``): node 0
takes none of another job (``Ranks.job``; Slurm's step and restart count are part of it), nor
one written before its own ranks' processes started, nor one whose ranks started after node
0's round was asked for (each less ``CLOCK_SKEW_S``). A rank's process starts before any
collective of its attempt, and the ranks of one attempt reach a step only together, so a
node's part of this attempt's tag is never older than node 0's ranks, and its ranks never
younger than node 0's request: a failed attempt's leftover always is older, and a later
attempt's part, met by a round of a failed attempt still waiting, always younger. A leftover
waits to be replaced by its node's part of this attempt (renamed over it), or goes when the
tag commits. A node other than 0 confirms only a marker that lists its own files with the
snapshots its done marker lists, and withdraws only its own done marker, never a later
attempt's of the same name.

A node that gives up waiting (``commit_timeout``), or whose ranks that asked for the tag all
died (a dead attempt: no rank is left to be told; node 0 then stops gathering too, so the
restart's save of the tag is not refused), withdraws its done marker before it tells its
ranks, and node 0 checks that every done marker is still there right before its marker
is renamed in, so a tag never commits on node 0 after another node said it failed (but
for the instant between that check and the rename, which a last look closes from the
other side: see ``await_marker``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from datastates.protocol.errors import CommitError
from datastates.protocol.fileio import remove, remove_names
from datastates.protocol.format import CommitMarker, done_name, marker_name

from .engine import Engine

log = logging.getLogger(__name__)

FIRST_LOOK_S = 0.05
"""The wait before the second look; each later wait is ``LOOK_GROWTH`` times the one before."""
LOOK_GROWTH = 1.5
LONGEST_LOOK_S = 1.0
"""The longest wait between two looks of node 0 (one listing each, whatever the number of nodes)."""
FEW_MISSING = 2
"""Up to this many done markers missing, node 0 opens each by name; more, it lists the folder instead (a folder of
16,384 rank files is a long listing: worth it only where it saves several opens)."""
LOOKS_PER_S = 1000
"""What the nodes other than node 0 ask the metadata server at most a second, together, while they await the tag's
marker: each waits at least ``(nodes - 1) / LOOKS_PER_S`` s between looks (2,048 nodes: 2 s), spread at random."""
CLOCK_SKEW_S = 1.0
"""How far the nodes' clocks may differ: a done marker older than node 0's attempt by more is a failed attempt's."""


@dataclass(frozen=True)
class Attempt:
    """The attempt of a job whose round node 0 commits: which done markers are its parts."""

    job: str
    began_ns: int
    """When the first of node 0's ranks in the round started its process (0: unknown)."""
    requested_ns: int
    """When node 0's round was asked for (its first rank's COMMIT)."""

    def refuses(self, done: CommitMarker, tag: str) -> str:
        """Why ``done`` is not a part of this attempt's commit of ``tag`` ('' when it is)."""
        skew = CLOCK_SKEW_S * 1e9
        if done.tag != tag:
            return f"it is of tag {done.tag!r}"
        if done.job != self.job:
            return f"it is of job {done.job!r}, not {self.job!r}"
        if self.began_ns and done.committed_ns < self.began_ns - skew:
            return (f"written {(self.began_ns - done.committed_ns) / 1e9:.1f} s before this node's ranks of the job "
                    "started: a failed attempt's")
        if done.began_ns and done.began_ns > self.requested_ns + skew:
            return (f"its ranks started {(done.began_ns - self.requested_ns) / 1e9:.1f} s after this node's ranks "
                    "asked to commit: a later attempt's")
        return ""


def _pauses(least: float, longest: float) -> Iterator[float]:
    """Seconds to wait before each next look: from ``FIRST_LOOK_S``, growing to ``longest``, never under ``least``;
    each within 20 % either way (never under ``least``), so nodes that began together do not keep looking together."""
    pause = FIRST_LOOK_S
    while True:
        yield max(least, pause * random.uniform(0.8, 1.2))
        pause = min(pause * LOOK_GROWTH, longest)


class NodeGather:
    """The waits of a multi-node commit, each bounded by the commit timeout."""

    def __init__(self, engine: Engine, timeout: float) -> None:
        self._engine = engine
        self._timeout = timeout

    async def gather(self, tag: str, folder: str, nodes: int, attempt: Attempt, present: Callable[[], bool],
                     ) -> tuple[dict[str, int], dict[str, str]]:
        """Node 0: every node's files (path → size, path → snapshot), from their done markers of ``attempt``;
        CommitError naming the nodes that never reported, or once no rank of this node that asked for the tag is
        ``present`` (the attempt died: its restart saves the tag anew, and must not find the dead attempt's round
        still holding its files)."""
        deadline = time.monotonic() + self._timeout
        names = {done_name(tag, node): node for node in range(nodes)}
        found: dict[int, CommitMarker] = {}
        stale: dict[int, str] = {}
        pauses = _pauses(0.0, LONGEST_LOOK_S)
        while True:
            missing = sorted(names.keys() - {done_name(tag, n) for n in found})
            if len(missing) > FEW_MISSING:  # one listing rather than an open each
                missing = await self._engine.flush(_present, folder, missing)
            for name in missing:
                marker = await self._engine.flush(CommitMarker.read, os.path.join(folder, name))
                if marker is None:
                    continue
                why = attempt.refuses(marker, tag)
                if not why:
                    found[names[name]] = marker
                elif stale.get(names[name]) != why:
                    stale[names[name]] = why
                    log.warning("tag %s: node %d's done marker in %s is not of this attempt (%s): waiting for its "
                                "part of this one", tag, names[name], folder, why)
            if len(found) == nodes:
                listed = [(os.path.join(folder, f.path), f) for mk in found.values() for f in mk.files]
                return {p: f.size for p, f in listed}, {p: f.snapshot for p, f in listed}
            if not present():
                raise CommitError(f"tag {tag!r} not committed: every rank of this node that asked for it is gone",
                                  tag=tag)
            if time.monotonic() > deadline:
                missing_nodes = [n for n in range(nodes) if n not in found]
                left = f"; what is there of node(s) {sorted(stale)} is another attempt's" if stale else ""
                raise CommitError(
                    f"tag {tag!r} not committed: node(s) {missing_nodes} wrote no done marker in {folder} within "
                    f"{self._timeout:.0f} s (their daemon or ranks may have died){left}", tag=tag,
                    missing=str(missing_nodes),
                )
            await asyncio.sleep(next(pauses))

    async def await_marker(self, tag: str, folder: str, mine: CommitMarker, present: Callable[[], bool],
                           ) -> CommitMarker:
        """A node other than 0: the tag's marker, once node 0 has written it after this node's done marker ``mine``,
        listing this node's files as ``mine`` does; CommitError if one lists others (another attempt's commit).

        Past the timeout, or once no rank that asked for the tag is ``present`` (its attempt
        died: none is left to be told), this node withdraws its done marker, then looks once more: node 0
        commits only while every done marker is in place (``still_reported``, right before its
        marker is renamed in), so a marker found now stands, and none found now never will be.
        """
        path, nodes = os.path.join(folder, marker_name(tag)), mine.nodes
        done = os.path.join(folder, done_name(tag, mine.node))
        deadline = time.monotonic() + self._timeout
        least = (nodes - 1) / LOOKS_PER_S
        pauses = _pauses(least, max(LONGEST_LOOK_S, least))
        await asyncio.sleep(least * random.random())  # the nodes' looks spread over the interval from the first
        while True:
            marker = await self._engine.flush(_newer_marker, path, mine.committed_ns)
            if marker is not None:
                return _listing(marker, mine, folder)
            if time.monotonic() > deadline or not present():
                break
            await asyncio.sleep(next(pauses))
        await self._engine.flush(_withdraw, done, mine)
        marker = await self._engine.flush(_newer_marker, path, mine.committed_ns)
        if marker is not None:
            return _listing(marker, mine, folder)
        if not present():
            raise CommitError(f"tag {tag!r} not committed: every rank of this node that asked for it is gone, so its "
                              f"part was taken back from {folder}", tag=tag)
        raise CommitError(f"tag {tag!r} not committed: node 0 wrote no marker in {folder} within {self._timeout:.0f} s", tag=tag)

    async def tidy(self, tag: str, folder: str, nodes: int) -> None:
        """Node 0, once the tag's marker is in place: every node's done marker goes (what cannot go is only logged:
        the tag is committed)."""
        await self._engine.flush(_best_effort, remove_names, folder, [done_name(tag, node) for node in range(nodes)])


def still_reported(tag: str, folder: str, nodes: int) -> None:
    """Node 0, right before its marker is renamed in: every node's done marker is still there (one listing); a node
    that gave up waiting took its own back and told its ranks the tag failed, so the tag must not commit now."""
    try:
        there = set(os.listdir(folder))
    except OSError as exc:
        raise CommitError(f"tag {tag!r} not committed: cannot list {folder} to check every node's done marker is "
                          f"there: {exc}", tag=tag) from None
    gone = [n for n in range(nodes) if done_name(tag, n) not in there]
    if gone:
        raise CommitError(f"tag {tag!r} not committed: node(s) {gone} gave up waiting for it and withdrew their done "
                          f"marker from {folder}", tag=tag, missing=str(gone))


def _listing(marker: CommitMarker, mine: CommitMarker, folder: str) -> CommitMarker:
    """``marker`` if it lists this node's files as its done marker ``mine`` does; else the tag was committed with
    another attempt's part of this node (a round of this node's still waiting when the job restarted): CommitError,
    so no rank of this attempt is told the tag holds its files."""
    listed = {f.path: f.snapshot for f in marker.files}
    if any(listed.get(f.path) != f.snapshot for f in mine.files):
        raise CommitError(f"tag {mine.tag!r} not committed with this node's files: its marker in {folder} lists "
                          "another attempt's (the job restarted while this node waited for node 0)", tag=mine.tag)
    return marker


def _withdraw(path: str, mine: CommitMarker) -> None:
    """Remove this node's done marker ``mine`` from ``path``, unless another (a later attempt's) has replaced it."""
    there = CommitMarker.read(path)
    if there is not None and (there.committed_ns, there.owner) == (mine.committed_ns, mine.owner):
        _best_effort(remove, path)


def _newer_marker(path: str, since_ns: int) -> CommitMarker | None:
    marker = CommitMarker.read(path)
    return marker if marker is not None and marker.committed_ns >= since_ns else None


def _present(folder: str, wanted: list[str]) -> list[str]:
    """Which of ``wanted`` are entries of ``folder`` now: one listing, however many are wanted (none where the
    listing fails: the next look tries again)."""
    try:
        return sorted(set(wanted).intersection(os.listdir(folder)))
    except OSError:
        return []


def _best_effort(fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)``; a failure is logged, not raised: a done marker left behind is tidied by the next daemon's
    start-up (its leftovers) and changes no commit."""
    try:
        fn(*args)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("removing done markers: %s", exc)
