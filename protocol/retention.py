"""Retention: which committed tags of a root to keep, and deleting the others so no reader is misled.

Shared by the daemon (``keep_last`` in node.yaml, applied after each commit), by
``datastatesctl prune`` and by ``CheckpointManager``. Only tags with a valid commit
marker count, so an uncommitted folder (a save in flight, or one a killed run left) is
never deleted, and the newest ``keep_last`` (at least one) always stay: a tag goes only
once a newer one is committed on the same root.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from .fileio import fsync_dir, remove
from .tags import CommittedTag, committed_tags

log = logging.getLogger(__name__)


def delete_tag(tag: CommittedTag, root: str) -> None:
    """Marker first, made durable before any file goes: a half-deleted tag is never taken as committed.

    A tag in a folder of its own goes with its folder. A tag sharing its folder with others
    (Lightning's files, one tag each) takes only the files its marker lists, those still there.
    Below ``root`` nothing is reached through a link, so a folder swapped for one deletes nothing elsewhere.
    """
    remove(tag.marker_path, trusted=root)
    fsync_dir(tag.folder, trusted=root)
    if tag.own_folder:
        remove(tag.folder, trusted=root, tree=True)
        fsync_dir(os.path.dirname(tag.folder), trusted=root)
    else:
        for rec in tag.marker.files:
            try:
                remove(os.path.join(tag.folder, rec.path), trusted=root)
            except FileNotFoundError:
                pass
        fsync_dir(tag.folder, trusted=root)
    log.info("deleted checkpoint %s of %s", tag.tag, tag.folder)


def prune(root: str, keep_last: int, spare: Iterable[str] = (), accept: Callable[[str], bool] = lambda tag: True,
          dry_run: bool = False) -> list[str]:
    """Delete the committed tags of ``root`` older than its ``keep_last`` newest; the folders deleted.

    ``spare`` are tags never deleted (being saved again right now, say); ``dry_run`` only lists.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}: the newest committed tag always stays")
    spare = set(spare)
    gone = []
    for tag in committed_tags(root, own_folder=True, accept=accept)[keep_last:]:
        if tag.tag in spare:
            continue
        if not dry_run:
            delete_tag(tag, root)
        gone.append(tag.folder)
    return gone
