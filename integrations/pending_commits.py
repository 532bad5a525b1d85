"""The commits a trainer integration handed to the daemon and has not taken in yet.

A commit resolves in the background while training goes on, so its outcome is looked at
later, at the next save or at the end: each one is taken in once, in order, a success lets
retention run, and a failure is raised as ``CommitError``. Every integration shares
this, so all report and prune alike.

One failure is not raised at the next save: a checkpoint lost with the daemon
(DaemonUnavailable: it died, restarted, or stalled past liveness). The client connects
again at that save, so training and checkpointing go on; the loss is logged once, as a
warning naming the checkpoints. ``wait()``, the caller asking for durability (at the
end), raises it like any other.
"""

from __future__ import annotations

import concurrent.futures
import logging
from concurrent.futures import Future
from typing import Callable

from datastates.protocol.errors import CommitError, DaemonUnavailable, SnapshotSkippedError, WaitTimeout

log = logging.getLogger(__name__)


class PendingCommits:
    """Commit futures of the checkpoints under ``where``, oldest first.

    ``on_committed`` runs when ``settle`` finds that at least one commit succeeded (the
    place to prune), after the resolved ones have left ``tags``.
    """

    def __init__(self, where: str, on_committed: Callable[[], None] = lambda: None) -> None:
        self.where = where
        self._on_committed = on_committed
        self._pending: list[tuple[str, Future]] = []

    def add(self, tag: str, fut: Future) -> None:
        self._pending.append((tag, fut))

    @property
    def tags(self) -> set[str]:
        """The tags whose commit has not been taken in: their files may still be written, so retention spares them."""
        return {tag for tag, _ in self._pending}

    def lost(self, tags: list[str], exc: DaemonUnavailable) -> None:
        """Say once that ``tags``, saved but not yet committed, were lost with the daemon (``exc``)."""
        if tags:
            log.warning("checkpoint(s) %s under %s lost: %s; training goes on, and the next save connects to the "
                        "daemon again", ", ".join(tags), self.where, exc.message)

    def settle(self, raise_lost: bool = False) -> None:
        """Take in the commits that have resolved: ``on_committed`` after a success, then raise the first failure
        (one lost with the daemon is logged instead, unless ``raise_lost``)."""
        done, pending = [], []
        for tag, fut in self._pending:
            (done if fut.done() else pending).append((tag, fut))
        self._pending = pending
        failed, lost, committed = [], [], False
        for tag, fut in done:
            exc = fut.exception()
            if exc is None:
                committed = True
            elif isinstance(exc, SnapshotSkippedError):  # on_busy="skip" chose to drop it: not an error
                log.warning("checkpoint %s skipped: %s", tag, exc.message)
            elif isinstance(exc, DaemonUnavailable) and not raise_lost:
                lost.append((tag, exc))
            else:
                failed.append((tag, exc))
        if lost:
            self.lost([tag for tag, _ in lost], lost[0][1])
        if committed:
            self._on_committed()
        if failed:
            tag, exc = failed[0]
            more = f" (and {len(failed) - 1} later one(s): {', '.join(t for t, _ in failed[1:])})" if failed[1:] else ""
            raise CommitError(f"checkpoint {tag} under {self.where} was not committed: {exc}{more}", tag=tag) from exc

    def wait(self, timeout: float | None = None, tags: set[str] | None = None) -> None:
        """Block until every commit (of ``tags`` only, if given) has resolved, then ``settle``; WaitTimeout if some
        are still open after ``timeout`` s."""
        waited = [f for tag, f in self._pending if tags is None or tag in tags]
        not_done = concurrent.futures.wait(waited, timeout).not_done
        if not_done:
            raise WaitTimeout(f"{len(not_done)} checkpoint commit(s) under {self.where} not answered within {timeout} s")
        self.settle(raise_lost=True)
