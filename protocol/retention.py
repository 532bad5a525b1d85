"""Retention: which committed tags of a root to keep, and deleting the others so no reader is misled.

Shared by the daemon (``keep_last`` in node.yaml, applied after each commit), by
``datastatesctl prune`` and by ``CheckpointManager``. Only tags with a valid commit
marker count, so an uncommitted folder (a save in flight, or one a killed run left) is
never deleted, and the newest ``keep_last`` (at least one) always stay: a tag goes only
once a newer one is committed on the same root.

Deleting a tag's folder takes as long as it holds files (thousands, for a sharded job), and
whoever deletes it may be killed meanwhile. So the folder is first renamed, in one step, to
a hidden name that says it is being deleted (``deleting_name``): from then on no reader
sees it, and whatever a killed delete leaves under that name, the next ``prune`` of its
folder, or the next daemon start (daemon/versions.py), deletes (``finish_delete``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from .fileio import fsync_dir, open_folder, remove
from .format import DELETING_RE, deleting_name
from .tags import CommittedTag, committed_tags, untrusted_folder

log = logging.getLogger(__name__)


def delete_tag(tag: CommittedTag, root: str) -> None:
    """Withdraw the tag in one durable step before any file goes: a half-deleted tag is never taken as committed.

    A tag in a folder of its own is renamed to its deleting name (the withdrawal), then goes
    whole. A tag sharing its folder with others (Lightning's files, one tag each) loses its
    marker first, then the files its marker lists, those still there. Below ``root`` nothing
    is reached through a link, so a folder swapped for one deletes nothing elsewhere.
    """
    if tag.own_folder:
        doomed = os.path.join(tag.run, deleting_name(tag.tag))
        parent = open_folder(tag.run, trusted=root)
        try:
            os.rename(tag.tag, os.path.basename(doomed), src_dir_fd=parent, dst_dir_fd=parent)
            os.fsync(parent)
        finally:
            os.close(parent)
        remove(doomed, trusted=root, tree=True)
        fsync_dir(tag.run, trusted=root)
    else:
        remove(tag.marker_path, trusted=root)
        fsync_dir(tag.folder, trusted=root)
        for rec in tag.marker.files:
            try:
                remove(os.path.join(tag.folder, rec.path), trusted=root)
            except FileNotFoundError:
                pass
        fsync_dir(tag.folder, trusted=root)
    log.info("deleted checkpoint %s of %s", tag.tag, tag.folder)


def finish_delete(folder: str, root: str) -> bool:
    """Delete ``folder`` if it is what a killed delete left (DELETING_RE) and this user's own; whether it went.

    Only a folder this user may trust (``untrusted_folder``) goes: a folder another user
    planted under that name, or a link, is left alone (and logged), never followed.
    """
    if not DELETING_RE.fullmatch(os.path.basename(folder)):
        return False
    why = untrusted_folder(folder)
    if why:
        log.warning("not finishing the delete of %s: %s", folder, why)
        return False
    try:
        remove(folder, trusted=root, tree=True)
        fsync_dir(os.path.dirname(folder), trusted=root)
    except OSError as exc:
        log.warning("cannot finish deleting %s (%s); the next prune or daemon start tries again", folder, exc.strerror)
        return False
    log.info("finished deleting %s, which an interrupted delete left", folder)
    return True


def prune(root: str, keep_last: int, spare: Iterable[str] = (), accept: Callable[[str], bool] = lambda tag: True,
          dry_run: bool = False) -> list[str]:
    """Delete the committed tags of ``root`` older than its ``keep_last`` newest; the folders deleted.

    ``spare`` are tags never deleted (being saved again right now, say); ``dry_run`` only lists.
    What an interrupted delete left in ``root`` goes first (``finish_delete``).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}: the newest committed tag always stays")
    spare = set(spare)
    if not dry_run:
        _finish_deletes(root)
    gone = []
    for tag in committed_tags(root, own_folder=True, accept=accept)[keep_last:]:
        if tag.tag in spare:
            continue
        if not dry_run:
            delete_tag(tag, root)
        gone.append(tag.folder)
    return gone


def _finish_deletes(root: str) -> None:
    """``finish_delete`` every folder of ``root`` named as being deleted."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        finish_delete(os.path.join(root, name), root)
