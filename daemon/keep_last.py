"""Retention after a commit: a run folder with ``keep_last`` keeps its newest tags and deletes the rest.

A tag being saved again, or held by a listener (a tier transfer under way), is never
deleted; a tag that cannot be deleted is logged, and the commit that led to it stands.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from datastates.protocol.retention import prune

from .config import StorageConfig
from .engine import Engine
from .events import CommitListener

log = logging.getLogger(__name__)


class KeepLast:
    """Each run folder's retention, run after each commit there."""

    def __init__(self, engine: Engine, storage: StorageConfig, listeners: Sequence[CommitListener],
                 held: Callable[[], set[str]]) -> None:
        """``held``: tags with snapshots not yet committed; ``listeners``: told what went, asked what they hold."""
        self._engine = engine
        self._storage = storage
        self._listeners = listeners
        self._held = held

    async def after_commit(self, parent: str) -> None:
        """Prune the run folder ``parent`` to its ``keep_last``, if it has one."""
        keep_last = self._storage.keep_last_at(parent)
        if keep_last is None:
            return
        try:
            gone = await self._engine.flush(prune, parent, keep_last, self.open_tags())
        except OSError as exc:
            log.warning("keep_last: pruning %s failed: %s", parent, exc)
            return
        for listener in self._listeners:
            listener.pruned(gone)

    def open_tags(self) -> set[str]:
        """Tags with snapshots not yet committed (being saved again), or held by a listener (a tier transfer)."""
        return self._held().union(*(listener.holds() for listener in self._listeners))
