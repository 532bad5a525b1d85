"""The daemon's table of snapshots: every one admitted, by id, and the order of admission.

Clients do not wait for the admission reply, so a WAIT or COMMIT can arrive while the
snapshot it is about is still being admitted on a thread; and one client's snapshots are
admitted in order (same-path renames and ``on_busy`` rely on it). The table tracks both.
Finished snapshots stay for ``status`` and for a WAIT that names them, up to SNAPSHOT_HISTORY.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from typing import Any, AsyncIterator

from .config import SNAPSHOT_HISTORY
from .snapshot import AdmittedSnapshot


class Admissions:
    """Every snapshot admitted, by id, and the admissions still under way, per client."""

    def __init__(self) -> None:
        self._snapshots: dict[int, AdmittedSnapshot] = {}
        self._finished: collections.deque[int] = collections.deque()
        self._ids = itertools.count(1)
        self._admitting: dict[str, set[asyncio.Future]] = {}

    def next_id(self) -> int:
        return next(self._ids)

    def add(self, snapshot: AdmittedSnapshot) -> None:
        self._snapshots[snapshot.id] = snapshot

    def finished(self, snapshot: AdmittedSnapshot) -> None:
        """``snapshot`` is durable or failed: kept for status, the oldest finished ones forgotten."""
        self._finished.append(snapshot.id)
        while len(self._finished) > SNAPSHOT_HISTORY:
            self._snapshots.pop(self._finished.popleft(), None)

    def get(self, snapshot_id: int) -> AdmittedSnapshot | None:
        return self._snapshots.get(snapshot_id)

    def of_client(self, client_id: str) -> list[AdmittedSnapshot]:
        return [s for s in self._snapshots.values() if s.client_id == client_id]

    def pending(self) -> list[AdmittedSnapshot]:
        return [s for s in self._snapshots.values() if s.pending]

    def pending_at(self, path: str) -> list[AdmittedSnapshot]:
        """Earlier snapshots of ``path`` still in flight: a new one is renamed into place only after them."""
        return [s for s in self._snapshots.values() if s.path == path and s.pending]

    def busy(self, client_id: str, tag: str) -> str:
        """Why a new tag's snapshot would queue behind an older tag's, or '' if it would not."""
        older = next((s for s in self._snapshots.values() if s.client_id == client_id and s.tag != tag and s.pending), None)
        return "" if older is None else f"tag {older.tag!r} is still {older.state.value} {older.path}"

    @contextlib.asynccontextmanager
    async def admitting(self, client_id: str) -> AsyncIterator[None]:
        """One client's admissions in order: enter after its earlier SNAPSHOTs are admitted."""
        before = list(self._admitting.get(client_id, ()))
        mine = asyncio.get_running_loop().create_future()  # registered before any await: see admitted()
        self._admitting.setdefault(client_id, set()).add(mine)
        try:
            if before:
                await asyncio.wait(before)
            yield
        finally:
            mine.set_result(None)
            self._admitting[client_id].discard(mine)
            if not self._admitting[client_id]:
                del self._admitting[client_id]

    async def admitted(self, client_id: str) -> None:
        """Return once the client's SNAPSHOTs sent before this request are admitted (or refused)."""
        pending = list(self._admitting.get(client_id, ()))
        if pending:
            await asyncio.wait(pending)

    def any_admitting(self) -> bool:
        return any(self._admitting.values())

    def status(self) -> list[dict[str, Any]]:
        return [s.status() for s in self._snapshots.values()]
