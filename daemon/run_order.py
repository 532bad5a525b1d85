"""A run's commit order: each commit's sequence in its run folder, as COMMITs arrive (``CommitMarker.sequence``).

A run folder holds one training run's tags; readers take the tag with the highest sequence
as the newest, whatever the order the commits finished in. The first sequence of a run is
read from its committed markers, and read again at every commit, since another writer of
the run may have committed meanwhile.
"""

from __future__ import annotations

import asyncio
import os
from typing import Callable

from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import CommitError
from datastates.protocol.tags import next_sequence

from .config import StorageConfig
from .engine import Engine
from .snapshot import AdmittedSnapshot


class RunOrder:
    """The sequences handed out, per run folder."""

    def __init__(self, engine: Engine, storage: StorageConfig, place: Callable[[str, dict[str, int]], str]) -> None:
        """``place``: (tag, files) → the tag's folder (``commit.tag_folder``); CommitError if none."""
        self._engine = engine
        self._storage = storage
        self._place = place
        self._sequences: dict[str, int] = {}
        """Per run folder, the last sequence handed out: read from its markers once, then counted here."""
        self._sequence_lock = asyncio.Lock()

    async def next(self, tag: str, admitted: list[AdmittedSnapshot], ranks: Ranks,
                   has_sequence: Callable[[], bool]) -> int:
        """The commit's place in its run, in the order COMMITs arrive (0 when it names no file, or none is needed).

        It costs a read of every committed marker of the run, so it is read where it is used
        only: by the first rank of a node's round (the round's sequence is its; ``has_sequence``
        says the round has one), and not on a node other than node 0 of a shared folder (node
        0's marker carries node 0's).
        """
        if not admitted or has_sequence():
            return 0
        try:
            folder = self._place(tag, {s.path: 0 for s in admitted})
        except CommitError:
            return 0  # refused when the marker is placed
        if ranks.num_nodes > 1 and ranks.node_rank != 0 and self._storage.shared(folder):
            return 0
        run = os.path.dirname(folder)
        async with self._sequence_lock:  # FIFO: sequences follow the order the requests came in
            if has_sequence():  # a rank ahead in this queue began the round meanwhile
                return 0
            # read again each time: another writer of this run (a trainer saving on its own after it lost this
            # daemon, another daemon after a restart) may have committed since, with a higher sequence
            on_disk = await self._engine.flush(next_sequence, run)
            self._sequences[run] = max(self._sequences.get(run, 0) + 1, on_disk)
            return self._sequences[run]
