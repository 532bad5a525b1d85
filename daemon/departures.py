"""Clients that leave, with BYE or without: what of theirs ends at once, and their decision folders' removal."""

from __future__ import annotations

import shutil
from typing import Any

from .admissions import Admissions
from .clients import ClientRecord, ClientRegistry
from .commit import CommitLedger


class Departures:
    """What the daemon does when a client goes: the ledger forgets its open tags, a multi-rank job's rounds it still
    owed fail now, its snapshots of its own memory not yet copied fail, and its decision folder goes once none of
    its snapshots can still claim an outcome there."""

    def __init__(self, ledger: CommitLedger, clients: ClientRegistry, snapshots: Admissions) -> None:
        self._ledger = ledger
        self._clients = clients
        self._snapshots = snapshots
        self._left: dict[str, str] = {}
        """Decision folders of clients that left, removed once none of their snapshots is pending."""

    def depart(self, record: ClientRecord, said_bye: bool) -> None:
        """A client gone, with BYE or without: its open tags go, and the rounds its rank still owed a commit fail now
        for the ranks waiting in them (a rank that left never commits them), not at commit_timeout. Unless it said
        BYE while another client of that rank is still here (a process may hold several), which may yet commit them;
        a killed rank's restart saves anew, in the next round."""
        opened = self._ledger.forget(record.id)
        if not said_bye:
            self._ledger.died(record.id)
        if record.decisions:
            self._left[record.id] = record.decisions
            self.tidy(record.id)
        if record.ranks.world_size > 1 and not (said_bye and self._clients.has_rank(record.ranks)):
            self._ledger.rank_lost(record.ranks, opened, self._clients.of_job(record.ranks))

    def tidy(self, client_id: str) -> None:
        """Remove a departed client's decision folder once no snapshot of it can still claim an outcome there."""
        if client_id in self._left and not any(s.pending for s in self._snapshots.of_client(client_id)):
            shutil.rmtree(self._left.pop(client_id), ignore_errors=True)

    def gone(self, record: ClientRecord, how: str) -> dict[str, Any]:
        """A client gone without BYE: its open tags go, its snapshots of its own memory not yet copied fail, the rest
        finish."""
        self.depart(record, said_bye=False)
        mine = self._snapshots.of_client(record.id)
        why = ("its trainer abandoned it (it gave this daemon up: stalled past liveness, or gone)" if how == "left"
               else f"its trainer {how}")
        abandoned = sum(s.abandon_trainer_copy(why) for s in mine)
        return {"pending_snapshots": sum(1 for s in mine if s.pending) - abandoned, "abandoned_snapshots": abandoned}
