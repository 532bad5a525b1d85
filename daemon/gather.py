"""The nodes of one job meet in a tag's shared folder: node 0 gathers the done markers, the others await its marker.

Each node writes a durable done marker of its files (daemon/commit.py); node 0 waits for
every node's, then writes the tag's marker; the other nodes wait for that marker. All of
it goes through the shared file system, whose metadata server is what a large job runs
short of first (docs/scale.md), so every wait is frugal with it:

- node 0 lists the tag's folder once a look and opens only the done markers that have
  appeared, never one per missing node;
- the other nodes look for the one marker less often the more nodes there are, so that
  all of them together ask at most ``LOOKS_PER_S`` a second, however many wait;
- each wait starts short (a commit whose nodes are all done costs a look or two) and
  grows, so a node that is late by minutes costs a look a second, not a storm;
- node 0 removes the done markers through one descriptor of the folder.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from typing import Iterator

from datastates.protocol.errors import CommitError
from datastates.protocol.fileio import remove, remove_names
from datastates.protocol.format import CommitMarker, done_name, marker_name

from .engine import Engine

FIRST_LOOK_S = 0.05
"""The wait before the second look; each later wait is ``LOOK_GROWTH`` times the one before."""
LOOK_GROWTH = 1.5
LONGEST_LOOK_S = 1.0
"""The longest wait between two looks of node 0 (one listing each, whatever the number of nodes)."""
LOOKS_PER_S = 1000
"""What the nodes other than node 0 ask the metadata server at most a second, together, while they await the tag's
marker: each waits at least ``(nodes - 1) / LOOKS_PER_S`` s between looks (2,048 nodes: 2 s), spread at random."""


def _pauses(least: float, longest: float) -> Iterator[float]:
    """Seconds to wait before each next look: from ``FIRST_LOOK_S``, growing to ``longest``, never under ``least``;
    each within 20 % either way, so nodes that began together do not keep looking together."""
    pause = FIRST_LOOK_S
    while True:
        yield max(least, pause) * random.uniform(0.8, 1.2)
        pause = min(pause * LOOK_GROWTH, longest)


class NodeGather:
    """The waits of a multi-node commit, each bounded by the commit timeout."""

    def __init__(self, engine: Engine, timeout: float) -> None:
        self._engine = engine
        self._timeout = timeout

    async def gather(self, tag: str, folder: str, nodes: int) -> tuple[dict[str, int], dict[str, str]]:
        """Node 0: every node's files (path → size, path → snapshot), from their done markers; CommitError naming the
        nodes that never reported."""
        deadline = time.monotonic() + self._timeout
        names = {done_name(tag, node): node for node in range(nodes)}
        found: dict[int, CommitMarker] = {}
        pauses = _pauses(0.0, LONGEST_LOOK_S)
        while True:
            for name in await self._engine.flush(_present, folder, names.keys() - {done_name(tag, n) for n in found}):
                marker = await self._engine.flush(CommitMarker.read, os.path.join(folder, name))
                if marker is not None and marker.tag == tag:
                    found[names[name]] = marker
            if len(found) == nodes:
                listed = [(os.path.join(folder, f.path), f) for mk in found.values() for f in mk.files]
                return {p: f.size for p, f in listed}, {p: f.snapshot for p, f in listed}
            if time.monotonic() > deadline:
                missing = [n for n in range(nodes) if n not in found]
                raise CommitError(
                    f"tag {tag!r} not committed: node(s) {missing} wrote no done marker in {folder} within "
                    f"{self._timeout:.0f} s (their daemon or ranks may have died)", tag=tag, missing=str(missing),
                )
            await asyncio.sleep(next(pauses))

    async def await_marker(self, tag: str, folder: str, since_ns: int, nodes: int) -> CommitMarker:
        """A node other than 0: the tag's marker, once node 0 has written it (after this node's done marker)."""
        path = os.path.join(folder, marker_name(tag))
        deadline = time.monotonic() + self._timeout
        least = (nodes - 1) / LOOKS_PER_S
        pauses = _pauses(least, max(LONGEST_LOOK_S, least))
        await asyncio.sleep(least * random.random())  # the nodes' looks spread over the interval from the first
        while time.monotonic() <= deadline:
            marker = await self._engine.flush(CommitMarker.read, path)
            if marker is not None and marker.committed_ns >= since_ns:
                return marker
            await asyncio.sleep(next(pauses))
        raise CommitError(f"tag {tag!r} not committed: node 0 wrote no marker in {folder} within {self._timeout:.0f} s", tag=tag)

    async def withdraw(self, tag: str, folder: str, node: int) -> None:
        """This node's done marker goes: its ranks are told the tag failed, so node 0 must not commit it later."""
        try:
            await self._engine.flush(remove, os.path.join(folder, done_name(tag, node)))
        except (FileNotFoundError, NotADirectoryError):
            pass

    async def tidy(self, tag: str, folder: str, nodes: int) -> None:
        """Node 0, once the tag's marker is in place: every node's done marker goes."""
        await self._engine.flush(remove_names, folder, [done_name(tag, node) for node in range(nodes)])


def _present(folder: str, wanted: set[str]) -> list[str]:
    """Which of ``wanted`` are entries of ``folder`` now: one listing, however many are wanted."""
    try:
        return sorted(wanted.intersection(os.listdir(folder)))
    except (FileNotFoundError, NotADirectoryError):
        return []
