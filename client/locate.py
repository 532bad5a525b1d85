"""Finding what to restore: which tag, and on which storage tier.

With ``storage.tiers``, one folder of checkpoints exists once per tier (the same path
below each tier's root). The tag is the newest committed on any of them, so a tag still
being copied to the slow tier is restored from the fast one. In a multi-node job only
shared tiers decide the tag: a node-local tier of one node may hold a step the others
lack, and ranks must never mix steps (dlrover#1233). The bytes are then read from the
fastest tier that holds that tag committed.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, TypeVar

from datastates.protocol.paths import home_tier
from datastates.protocol.descriptors import Tier
from datastates.protocol.errors import CheckpointGoneError, CommitError, DatastatesError, StorageError
from datastates.protocol.format import CommitMarker, marker_name
from datastates.protocol.storage import backend_for
from datastates.protocol.tags import newest, trusted_marker

log = logging.getLogger(__name__)

RESTORE_TRIES = 8
"""How many tags in a row a restore may find deleted while it reads them before it gives up."""
OBJECT_WAIT_S = 30.0
"""How long a restore that found a tag on a file tier waits for an object store tier to say whether it holds a newer
one, before it goes on without it (a hung server fails each request only after GIVE_UP_S, and a look there makes
several in turn: a listing, then the markers)."""
T = TypeVar("T")


@dataclass(frozen=True)
class Located:
    tag: str
    folder: str
    marker: CommitMarker
    tier: str
    """The tier's name, or '' where ``root`` lies in no tier."""
    written: str
    """The tag's folder on the first tier (or under ``root``): where snapshots were written, and the daemon's replica is of."""


def latest(root: str | os.PathLike) -> str | None:
    """The newest tag under ``root`` (in it or one folder down) with a valid commit marker."""
    best = newest(os.fspath(root))
    return best.tag if best else None


def tier_roots(root: str, tiers: list[Tier]) -> list[tuple[Tier | None, str]]:
    """``root`` as it lies on each tier, fastest first; just ``root`` if it is in no tier."""
    real = backend_for(root).absolute(root, resolve=True)
    home = home_tier(tiers, real)
    if home is None:
        return [(None, root)]
    return [(t, t.place(real, tiers[home])) for t in tiers]


def locate(root: str, tiers: list[Tier], tag: str | None = None, multi_node: bool = False) -> Located | None:
    """The committed copy of ``tag`` (default: the newest committed) to read; None if no tag is committed."""
    places = tier_roots(root, tiers)
    if tag is None:
        deciding = [(t, r) for t, r in places if t is None or t.shared or not multi_node] or places
        found = newest_of([r for _, r in deciding], strict=multi_node)
        if not found:
            return None
        tag = max(found, key=lambda mk: mk.newness).tag
    unreadable: StorageError | None = None
    for tier, place in places:  # fastest first
        folder = os.path.join(place, tag)
        try:
            marker = trusted_marker(os.path.join(folder, marker_name(tag)))
        except DatastatesError as exc:  # StorageError; ConfigError with no boto3 here
            if not backend_for(place).unreachable(exc):
                raise
            log.warning("cannot read %s, looking on the other tiers: %s", folder, exc.message)
            unreadable = unreadable or StorageError(f"cannot read {folder}, and no other tier holds tag {tag!r} "
                                                    f"committed: {exc.message}", path=folder)
            continue
        if marker is not None:
            return Located(tag, folder, marker, tier.name if tier else "", os.path.join(places[0][1], tag))
    if unreadable is not None:  # not "not committed": that tier may well hold it
        raise unreadable
    where = ", ".join(r for _, r in places)
    raise CommitError(f"tag {tag!r} is not committed under {where} (no valid {marker_name(tag)})", tag=tag)


def newest_of(places: list[str], strict: bool) -> list[CommitMarker]:
    """The newest committed tag's marker at each of ``places``, the tiers that decide the tag, where one is committed.

    An object store is read on a thread of its own beside the file tiers. Where a file tier holds a tag, one that
    cannot be read (down, refusing, or any one of its marker objects: that one might be the newest) or has not
    answered within OBJECT_WAIT_S (a hung server: each of its requests fails only after GIVE_UP_S) is left out, with
    a warning: one node alone restores what its other tiers hold. Where none does, an object store is waited for
    (a hung one fails within GIVE_UP_S a request), and one that cannot be read raises StorageError: "nothing to
    restore" would start the training afresh.

    ``strict`` (a job of several nodes, where the shared tiers decide for every node): no place is left out, and one
    that cannot be read raises StorageError; nodes that could and nodes that could not read it would otherwise
    restore different steps.
    """
    probes = {p: backend_for(p).probe(newest, p) for p in places}  # a file system's answered here, an error raised
    answered = {p: f.result() for p, f in probes.items() if f.done() and f.exception() is None}
    found = [c.marker for c in answered.values() if c is not None]
    until = time.monotonic() + OBJECT_WAIT_S if found and not strict else None
    unreadable: list[tuple[str, DatastatesError]] = []
    for place, probe in probes.items():
        if place in answered:
            continue
        try:
            got = probe.result(None if until is None else max(0.0, until - time.monotonic()))
        except FutureTimeout:
            log.warning("%s has not answered in %.0f s: restoring from the other tiers", place, OBJECT_WAIT_S)
            continue
        except DatastatesError as exc:  # StorageError; ConfigError with no boto3 here
            unreadable.append((place, exc))
            continue
        if got is not None:
            found.append(got.marker)
    for place, exc in unreadable:
        if strict or not found:
            why = ("a shared tier that decides the step every node of this job restores, so this node cannot pick "
                   "one" if strict else "and no other tier holds a committed tag, so whether one exists is unknown")
            raise StorageError(f"cannot read {place}, {why}: {exc.message}", path=place) from None
        log.warning("cannot read %s, restoring from the other tiers: %s", place, exc.message)
    return found


def again_if_deleted(restore: Callable[[], T], root: str) -> T:
    """``restore()``, which picks a committed tag under ``root`` and reads it, again while a file vanishes under it.

    Another job's prune (``datastatesctl prune``, the daemon's ``keep_last``, another
    manager's) may delete the tag between its pick and its read, once a newer one is
    committed: the read then meets a missing file, and the tag is picked anew (a tag asked
    for by name is then not committed, CommitError). CheckpointGoneError after
    ``RESTORE_TRIES`` tags in a row.
    """
    for _ in range(RESTORE_TRIES):
        try:
            return restore()
        except FileNotFoundError as exc:
            gone = exc.filename
            log.info("%s was deleted while it was being restored (another job's prune?): the newest committed tag "
                     "under %s is looked for again", gone, root)
    raise CheckpointGoneError(f"{RESTORE_TRIES} checkpoints in a row under {root} were deleted while they were being "
                              f"restored, the last {gone}: another job prunes there as fast as it commits; restore "
                              "again", path=gone)
