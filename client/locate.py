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
from dataclasses import dataclass
from typing import Callable, TypeVar

from datastates.protocol.paths import home_tier
from datastates.protocol.descriptors import Tier
from datastates.protocol.errors import CheckpointGoneError, CommitError, DatastatesError
from datastates.protocol.format import CommitMarker, marker_name
from datastates.protocol.objectstore import is_object
from datastates.protocol.tags import newest, trusted_marker

log = logging.getLogger(__name__)

RESTORE_TRIES = 8
"""How many tags in a row a restore may find deleted while it reads them before it gives up."""
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
    real = root.rstrip("/") if is_object(root) else os.path.realpath(root)
    home = home_tier(tiers, real)
    if home is None:
        return [(None, root)]
    return [(t, t.place(real, tiers[home])) for t in tiers]


def locate(root: str, tiers: list[Tier], tag: str | None = None, multi_node: bool = False) -> Located | None:
    """The committed copy of ``tag`` (default: the newest committed) to read; None if no tag is committed."""
    places = tier_roots(root, tiers)
    if tag is None:
        deciding = [(t, r) for t, r in places if t is None or t.shared or not multi_node] or places
        found = [c.marker for c in (readable(newest, r) for _, r in deciding) if c is not None]
        if not found:
            return None
        tag = max(found, key=lambda mk: mk.newness).tag
    for tier, place in places:
        folder = os.path.join(place, tag)
        marker = readable(trusted_marker, os.path.join(folder, marker_name(tag)))
        if marker is not None:
            return Located(tag, folder, marker, tier.name if tier else "", os.path.join(places[0][1], tag))
    where = ", ".join(r for _, r in places)
    raise CommitError(f"tag {tag!r} is not committed under {where} (no valid {marker_name(tag)})", tag=tag)


def readable(read: Callable[[str], T], place: str) -> T | None:
    """``read(place)``; None, logged, where ``place`` is an object store that cannot be read now (down, refusing): a
    restore then takes what the other tiers hold."""
    try:
        return read(place)
    except DatastatesError as exc:  # StorageError; ConfigError with no boto3 here
        if not is_object(place):
            raise
        log.warning("cannot read %s, restoring from the other tiers: %s", place, exc.message)
        return None


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
