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
folder, or the next daemon start (daemon/resave.py), deletes (``finish_delete``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from .fileio import RENAME_NOREPLACE, fsync_dir, open_folder, read_regular, remove, rename_within
from .format import DELETING_RE, TRACKER, CommitMarker, deleting_name, marker_name
from .storage import backend_for
from .tags import CommittedTag, committed_tags, marker_paths, untrusted_folder

log = logging.getLogger(__name__)


def delete_tag(tag: CommittedTag, root: str) -> bool:
    """Withdraw the tag in one durable step before any file goes: a half-deleted tag is never taken as committed.

    A tag in a folder of its own is renamed to its deleting name (the withdrawal), then goes
    whole. A tag sharing its folder with others (Lightning's files, one tag each) loses its
    marker first, then the files its marker lists, those still there. Below ``root`` nothing
    is reached through a link, so a folder swapped for one deletes nothing elsewhere.

    Whether it went: a tag that is no longer as listed stays, and is logged (``kept``): its
    folder gone already (another prune's), committed again since, or holding another tag's marker.
    """
    why = kept(tag, tag.folder)
    if why:
        log.warning("not deleting checkpoint %s of %s: %s", tag.tag, tag.folder, why)
        return False
    if tag.own_folder:
        for older in older_versions(tag):  # first: once its folder goes, the tag must not stand with one of these
            remove(older.marker_path, trusted=root)
            fsync_dir(older.folder, trusted=root)
            log.info("withdrew %s's older marker in %s with it", tag.tag, older.folder)
        doomed = os.path.join(tag.run, deleting_name(tag.tag))
        try:
            parent = open_folder(tag.run, trusted=root)
        except FileNotFoundError:
            log.warning("not deleting checkpoint %s of %s: its run folder is gone", tag.tag, tag.folder)
            return False
        try:
            try:
                os.rename(tag.tag, os.path.basename(doomed), src_dir_fd=parent, dst_dir_fd=parent)
            except FileNotFoundError:  # deleted or renamed meanwhile: another prune's
                log.warning("not deleting checkpoint %s of %s: it is gone already", tag.tag, tag.folder)
                return False
            why = kept(tag, doomed)  # committed again between the listing and the rename: renamed back
            if why:
                # but not without its marker: another prune, finishing what it found under a deleting name, is
                # deleting it (or has); renamed back it would be an uncommitted folder no prune ever deletes
                if CommitMarker.read(os.path.join(doomed, marker_name(tag.tag))) is not None:
                    rename_within(parent, os.path.basename(doomed), tag.tag, RENAME_NOREPLACE)
                log.warning("not deleting checkpoint %s of %s: %s", tag.tag, tag.folder, why)
                return False
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
    return True


def older_versions(tag: CommittedTag) -> list[CommittedTag]:
    """The markers of ``tag`` in other folders of its run folder (saved into another tag's folder), older than it.

    Readers take a tag's newest marker, so while ``tag`` stands these change nothing; once
    its folder is deleted, the tag would stand again with one of them, an older step the
    trainer was never told is its newest. Only the markers go: the files they list may be
    listed by the other tag of that folder too.
    """
    return [c for c in committed_tags(tag.run) if c.tag == tag.tag and c.folder != tag.folder
            and c.marker.newness < tag.marker.newness]


def tracker_names(run: str, tag: str) -> bool:
    """Whether the ``latest`` tracker of folder ``run`` names ``tag``."""
    try:
        return read_regular(os.path.join(run, TRACKER)).decode(errors="replace").strip() == tag
    except OSError:
        return False


def kept(tag: CommittedTag, folder: str) -> str:
    """Why ``folder``, the listed ``tag``'s folder, must not be deleted now ("" if it may).

    Its marker must still be the one listed: a daemon's new version of the tag, switched in
    since (the trainer was told it is committed), is not this listing's to delete. A tag folder
    of its own goes whole, so one that also holds another tag's marker (a "best" tag whose
    file was saved into it) stays, as ``Versions.switch`` refuses to replace it.
    """
    if not os.path.isdir(folder):
        return "it is gone already"
    now = CommitMarker.read(os.path.join(folder, marker_name(tag.tag)))
    if now != tag.marker:
        return "it was committed again since it was listed" if now is not None else "its commit marker is gone"
    if tag.own_folder and tracker_names(tag.run, tag.tag):
        return (f"the {TRACKER!r} tracker beside it names it (a commit after it did not move the tracker on): "
                "deleting it would leave the tracker naming nothing")
    if tag.own_folder:
        others = [os.path.basename(p) for p in marker_paths(folder, depth=0)
                  if os.path.basename(p) != marker_name(tag.tag)]
        if others:
            return f"its folder also holds the commit marker(s) {others} of other tags, which would go with it"
    return ""


def finish_delete(folder: str, root: str) -> bool:
    """Delete ``folder`` if it is what a killed delete left (DELETING_RE) and this user's own; whether it went.

    Only a folder this user may trust (``untrusted_folder``), in a parent folder this user may
    trust, goes: a folder another user planted under that name, or a link, is left alone (and
    logged), never followed; and so is one in a folder others may write, where anyone could
    have renamed this user's committed tag folder to that name.
    """
    if not DELETING_RE.fullmatch(os.path.basename(folder)):
        return False
    why = untrusted_folder(folder) or untrusted_folder(os.path.dirname(folder))
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
    store = backend_for(root)
    if not dry_run:
        store.finish_deletes(root)
    gone = []
    for tag in committed_tags(root, own_folder=True, accept=accept)[keep_last:]:
        if tag.tag in spare:
            continue
        if dry_run:
            why = store.why_kept(tag)
            if why:
                log.warning("would not delete checkpoint %s of %s: %s", tag.tag, tag.folder, why)
                continue
        elif not store.delete_tag(tag, root):
            continue
        gone.append(tag.folder)
    return gone


def finish_deletes(root: str) -> None:
    """``finish_delete`` every folder of ``root`` named as being deleted."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        finish_delete(os.path.join(root, name), root)
