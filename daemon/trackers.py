"""The ``latest`` trackers beside a tag folder, which frameworks read to find the newest checkpoint.

A tracker names a tag only once the tag's marker exists, and never moves back: commits
that finish out of order (a slow tag after a faster later one) leave it on the newer tag.
"""

from __future__ import annotations

import asyncio
import os
import re
from typing import Awaitable, Callable

from datastates.protocol.format import MEGATRON_TRACKER, TRACKER

_ITERATION_RE = re.compile(r"^iter_(\d+)$")


def trackers(tag: str, folder: str) -> dict[str, bytes]:
    """The tracker files beside the tag folder that frameworks read to find the newest checkpoint."""
    parent = os.path.dirname(folder)
    out = {os.path.join(parent, TRACKER): tag.encode()}
    iteration = _ITERATION_RE.match(tag)
    if iteration:
        out[os.path.join(parent, MEGATRON_TRACKER)] = str(int(iteration.group(1))).encode()
    return out


class Trackers:
    """The daemon's trackers, each moved forward only."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self._tracked: dict[str, tuple[int, int]] = {}
        """Per tracker file, the (sequence, snapshot id) of the tag it names."""

    async def advance(self, tag: str, folder: str, order: tuple[int, int],
                      write: Callable[[str, bytes], Awaitable[None]]) -> None:
        """Point the trackers beside ``folder`` at ``tag`` (committed), unless they name a newer one (``order``)."""
        async with self._lock:  # one tracker write at a time, so renames land in order
            for tracker, data in trackers(tag, folder).items():
                if order >= self._tracked.get(tracker, (-1, -1)):
                    self._tracked[tracker] = order
                    await write(tracker, data)
