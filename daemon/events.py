"""What the commit ledger announces to the daemon's parts that follow commits (the tier transfers, the replicas).

Its own module so that those parts depend on the announcement, not on the ledger.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Protocol

from datastates.protocol.descriptors import Ranks


@dataclass(frozen=True)
class CommitEvent:
    """A node's files of a tag, durable, to commit where they lie; announced once committed on the first tier."""

    client_id: str
    tag: str
    files: dict[str, int]
    """Path → size."""
    ranks: Ranks
    requested_ns: int
    order: int
    """The newest snapshot id among the files: ties between equal sequences go to the newer snapshots."""
    sequence: int
    """The tag's place in its run's commit order (``CommitMarker.sequence``), fixed when the commit was asked for."""
    snapshots: dict[str, str] = field(default_factory=dict)
    """Path → the snapshot each file holds (``FileHeader.snapshot``), listed in the marker so readers can check it."""
    wanted: Callable[[], None] | None = None
    """Raises SnapshotFailedError once the trainer went on saving these files itself (it lost this daemon, and
    ``fallback="local"``): asked in the flush call that renames the marker in, and right before a version switch."""
    began_ns: int = 0
    """When the job's attempt began here (its ranks' first process start; 0: unknown): node 0 takes no done marker
    written before it (daemon/gather.py)."""
    present: Callable[[], bool] = lambda: True
    """Whether a rank that asked for the commit is still alive to be told: once none is, node 0 stops gathering
    the other nodes' done markers, and any other node stops waiting for node 0's marker and takes its own back."""

    def moved(self, place: Callable[[str], str]) -> CommitEvent:
        """The same commit with every file at ``place(path)``: a new version switched in, or a lower tier (which
        the trainer's later moves never concern: ``wanted`` stays with the first commit)."""
        return dataclasses.replace(self, files={place(p): n for p, n in self.files.items()},
                                   snapshots={place(p): s for p, s in self.snapshots.items()}, wanted=None,
                                   present=lambda: True)


class CommitListener(Protocol):
    """What the ledger announces, to the daemon's parts that follow commits (the tier transfers, the replicas)."""

    def committed(self, commit: CommitEvent) -> None:
        """``commit`` is committed on the tier its files were written to."""

    def pruned(self, folders: list[str]) -> None:
        """Retention deleted these tag folders."""

    def holds(self) -> set[str]:
        """Tags retention must not delete yet."""
