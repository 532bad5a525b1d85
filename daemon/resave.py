"""Versions of a tag: re-saving a committed tag writes a new version beside it, switched in with one atomic exchange.

Invariant I2: once ``commit(tag)`` has resolved, the committed bytes of that tag are never
changed. Saving the same paths again (Lightning's ``last.ckpt``, a rolling tag) would
otherwise rename new files over committed ones one by one, and a kill -9 or a full disk
in between would leave a tag that mixes two steps and still passes ``verify``.

So a snapshot whose tag is already committed in its tag folder ``V`` is written into a
hidden staging folder beside it, ``.<owner>-<n>.dsgen`` (short, whatever the length of ``V``'s
name), with the same layout. The new
version's marker is written there too; then ``renameat2(RENAME_EXCHANGE)`` swaps the two
folders in one step, and the old version, now under the hidden name, is deleted. At every
instant ``V`` holds one whole version: the old one, or the new one. Readers never look in
hidden folders, and a killed daemon's staging folders are removed by the next daemon
(their owner tag, daemon/instances.py). A path listed by another tag's committed marker is
refused: saving it would change that tag's bytes. A file system without RENAME_EXCHANGE
(some network file systems) fails the re-save's commit, and the old version stands.
"""

from __future__ import annotations

import errno
import itertools
import os
import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from datastates.protocol.errors import CommitError, PathNotAllowedError
from datastates.protocol.fileio import RENAME_EXCHANGE, open_folder, remove, rename_within
from datastates.protocol.format import STAGING_RE, CommitMarker, marker_name, staging_name
from datastates.protocol.paths import shallow_walk, within
from datastates.protocol.retention import finish_delete
from datastates.protocol.tags import file_commits

from datastates.protocol.storage import Gone, storage_error

log = logging.getLogger(__name__)

LEFTOVER_DEPTH = 3
"""Staging folders sit beside tag folders: <root>/<run>/.<owner>-<n>.dsgen is depth 2."""


def exchange(a: str, b: str) -> None:
    """Swap the sibling folders ``a`` and ``b`` atomically, through their parent's descriptor; then make it durable."""
    parent = open_folder(os.path.dirname(a))
    try:
        rename_within(parent, os.path.basename(a), os.path.basename(b), RENAME_EXCHANGE)
        os.fsync(parent)
    finally:
        os.close(parent)


@dataclass
class NewVersion:
    """A tag's next version, written in a hidden staging folder beside its committed one until switched in."""

    tag: str
    folder: str
    """The tag's folder, which holds its committed version."""
    staging: str
    """Where the new version is written until it is switched in."""

    def visible(self, path: str) -> str:
        """Where a file written in the staging folder appears once the version is switched in."""
        return os.path.join(self.folder, os.path.relpath(path, self.staging))


class Versions:
    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._open: dict[tuple[str, str], NewVersion] = {}
        """(tag folder, tag) → the staging folder of its next version, which new snapshots of the tag join."""
        self._sealed: list[NewVersion] = []
        """Staging folders whose commit has begun: a snapshot admitted meanwhile starts a version of its own."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # admission runs on executor threads

    def place(self, path: str, tag: str, folder: str, versioned: bool = True, committing: bool = False,
              roots: Sequence[str] | None = None) -> str:
        """Where a snapshot of ``path`` for ``tag`` (marker folder ``folder``) is written; refuses another tag's file.

        ``versioned`` False (a multi-node job, whose nodes cannot switch one folder together):
        a committed tag is refused instead of saved again. ``committing``: a commit of the tag in
        ``folder`` is in flight, so the tag counts as committed already (its marker may land before
        this snapshot's file is renamed into place). ``roots``: the daemon's, within which every
        marker listing ``path`` counts, whatever its folder's trust (``file_commits``).
        """
        others = sorted({mk.tag for _, mk, _ in file_commits(path, roots=roots) if mk.tag != tag})
        if others:
            raise PathNotAllowedError(f"path {path!r} refused: it is a file of committed tag(s) {others}, whose bytes "
                                      "must not change; save it under a new path, or under the same tag", path=path)
        with self._lock:
            staging = self._open.get((folder, tag))
            if staging is not None and not os.path.isdir(staging.staging):  # its run folder was deleted meanwhile
                del self._open[(folder, tag)]
                staging = None
            if staging is None:
                if not committing and not os.path.exists(os.path.join(folder, marker_name(tag))):
                    return path  # no committed version to protect
                if not versioned:
                    state = "being committed" if committing else "committed"
                    raise PathNotAllowedError(f"path {path!r} refused: tag {tag!r} is {state} in {folder}, and a "
                                              "multi-node job cannot save a committed tag again; use a new tag", path=path)
                name = staging_name(self._owner, next(self._ids))  # fits NAME_MAX beside any folder
                staging = NewVersion(tag, folder, os.path.join(os.path.dirname(folder), name))
                try:
                    os.close(open_folder(staging.staging, create=True))
                except OSError as exc:  # a full disk, say: a refusal of this snapshot, which fails its tag's commit
                    raise storage_error("cannot make a new version's folder for", path, exc) from None
                self._open[(folder, tag)] = staging
        return os.path.join(staging.staging, os.path.relpath(path, folder))

    def seal(self, paths: list[str]) -> None:
        """A commit of the version holding ``paths`` has begun: later snapshots of its tag go to a new staging folder.

        Without this, a snapshot admitted while the commit is in flight would be written into
        the folder being switched in, or into the old version once the two are exchanged.
        """
        with self._lock:
            for key, staging in list(self._open.items()):
                if any(within(p, staging.staging) for p in paths):
                    self._sealed.append(self._open.pop(key))

    def staged(self, tag: str, files: dict[str, int]) -> NewVersion | None:
        """The staging folder ``files`` were written to, if any; CommitError if only some of them were."""
        with self._lock:
            found = [s for s in [*self._open.values(), *self._sealed]
                     if s.tag == tag and any(within(p, s.staging) for p in files)]
        if not found:
            return None
        staging = found[0]
        if len(found) > 1 or not all(within(p, staging.staging) for p in files):
            raise CommitError(f"tag {tag!r} not committed: a new version of it mixes files inside and outside "
                              f"its folder {staging.folder}", tag=tag)
        return staging

    def abandon(self, paths: list[str]) -> None:
        """Remove the staging folders holding any of ``paths``: their version will never be committed."""
        with self._lock:
            gone = [key for key, s in self._open.items() if any(within(p, s.staging) for p in paths)]
            stagings = [self._open.pop(key) for key in gone]
            sealed = [s for s in self._sealed if any(within(p, s.staging) for p in paths)]
            self._sealed = [s for s in self._sealed if s not in sealed]
        for staging in stagings + sealed:
            _remove(staging.staging)

    @staticmethod
    def remove_leftovers(root: str, gone: Gone) -> list[str]:
        """Staging folders under ``root`` that killed daemons (``gone`` owners) left: an unfinished or a replaced
        version; and the tag folders a killed retention or ``datastatesctl prune`` had begun to delete."""
        removed = []
        for folder, dirs, _ in shallow_walk(root, LEFTOVER_DEPTH):
            for name in dirs:
                match = STAGING_RE.fullmatch(name)
                if match and gone(match.group(1), os.path.join(folder, name)):
                    _remove(os.path.join(folder, name), trusted=root)
                    removed.append(os.path.join(folder, name))
                elif finish_delete(os.path.join(folder, name), root):
                    removed.append(os.path.join(folder, name))
        return removed

    def switch(self, staging: NewVersion, ask: Callable[[], None] = lambda: None) -> None:
        """Put the new version (its marker written) in place of the old in one step, then delete the old.

        The swap moves the whole folder, so it is refused (the old version stands) while the
        folder holds anything its tag's committed version does not: another tag's marker or
        files, a save in progress. Those would be deleted with the old version.
        """
        strangers = _strangers(staging)
        if strangers:
            raise CommitError(f"tag {staging.tag!r} not committed again: its folder {staging.folder} also holds "
                              f"{strangers[:3]}, which are not its files and would go with its old version; save "
                              "each tag in a folder of its own. Its committed version stands", tag=staging.tag)
        ask()  # the last moment the trainer's own save of this tag (fallback="local") can still stop it
        try:
            exchange(staging.folder, staging.staging)
        except OSError as exc:
            why = ("this file system cannot swap folders atomically (renameat2 RENAME_EXCHANGE); save under a new tag"
                   if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) else exc.strerror)
            raise CommitError(f"tag {staging.tag!r} not committed again: {why}; its committed version stands",
                              tag=staging.tag) from None
        with self._lock:
            if self._open.get((staging.folder, staging.tag)) is staging:
                del self._open[(staging.folder, staging.tag)]
            self._sealed = [s for s in self._sealed if s is not staging]
        _remove(staging.staging)


def _remove(folder: str, trusted: str = "/") -> None:
    """Delete a staging folder, never through a link; one already gone, or not removable, is left to the next start."""
    try:
        remove(folder, trusted, tree=True)
    except OSError as exc:
        if not isinstance(exc, FileNotFoundError):
            log.warning("cannot remove staging folder %s (%s); the next daemon removes it", folder, exc.strerror)


def _strangers(staging: NewVersion) -> list[str]:
    """What the tag folder holds besides its tag's committed version: the entries the swap would delete."""
    marker = CommitMarker.read(os.path.join(staging.folder, marker_name(staging.tag)))
    mine = {marker_name(staging.tag)} | {f.path.split("/")[0] for f in (marker.files if marker else [])}
    try:
        return sorted(set(os.listdir(staging.folder)) - mine)
    except FileNotFoundError:
        return []
