"""Finding committed tags: the one scanner of commit markers, beside the format that defines them.

``latest()``, ``Client.restore``, retention (``keep_last``, ``prune``, ``CheckpointManager``),
``datastatesctl ls``/``verify`` and the tier resume after a restart all ask the same
question, "which tags under this root are committed, newest first", and all answer it here.
A tag is committed when its marker is whole and every file it lists has the size it
lists; anything else (a save in flight, a folder a crash left) is invisible to readers.
How a marker is found, read and checked where the path's storage keeps it is that storage
backend's to say (protocol/storage/: ``markers``, ``read_marker``, ``whole``, ``trusts``).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .errors import DatastatesError
from .format import (INDEX_AT, PREAMBLE_SIZE, CommitMarker, MarkerFile, header_snapshot, index_at, is_marker_name,
                     marker_name, parse_preamble)
from .storage import backend_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommittedTag:
    tag: str
    folder: str
    """The folder holding the marker: the tag's own folder (``<run>/<tag>/``), or the files' common folder."""
    marker: CommitMarker

    @property
    def marker_path(self) -> str:
        return os.path.join(self.folder, marker_name(self.tag))

    @property
    def files(self) -> list[str]:
        return tag_files(self.folder, self.marker)

    @property
    def own_folder(self) -> bool:
        """Whether the marker sits in a folder named after its tag, which retention may delete whole."""
        return os.path.basename(self.folder) == self.tag

    @property
    def run(self) -> str:
        """The folder holding the tag's folder: one run's tags, one after another."""
        return os.path.dirname(self.folder)


def tag_files(folder: str, marker: CommitMarker) -> list[str]:
    """The files a committed tag is made of: those its marker (in ``folder``) lists, as paths.

    What ``status`` (per commit), ``ls`` and ``verify`` count and check, and what COMMIT answers:
    one answer, whatever else (trackers, a half-written file, the marker itself) the folder holds.
    """
    return [os.path.join(folder, rec.path) for rec in marker.files]


def read_marker(path: str) -> CommitMarker | None:
    """The marker at ``path`` if it is whole and every file it lists has the size it lists."""
    store = backend_for(path)
    marker = store.read_marker(path)
    return marker if marker is not None and store.whole(os.path.dirname(path), marker) else None


def unlisted(folder: str, marker: CommitMarker, folder_fd: int | None = None, identity: bool = False) -> str:
    """Why a file ``marker`` lists is not in ``folder`` with its listed size ("" if every one is).

    ``folder_fd``: the folder's descriptor, to look the files up through (``folder`` then only names it).
    ``identity``: each file must also be the snapshot the marker lists (``file_snapshot``), as a
    commit checks right before its marker goes in: a file of the same size another writer put
    there meanwhile (a trainer saving the same path on its own) is not the one committed.
    """
    for rec in marker.files:
        try:
            if folder_fd is None:
                size = os.stat(os.path.join(folder, rec.path)).st_size
            else:
                size = os.stat(rec.path, dir_fd=folder_fd, follow_symlinks=False).st_size
            held = file_snapshot(rec.path, folder_fd) if identity and rec.snapshot and folder_fd is not None else None
        except OSError as exc:
            return f"its file {rec.path} is gone from {folder} ({exc.strerror})"
        if size != rec.size:
            return f"its file {rec.path} in {folder} is {size} bytes, not {rec.size}"
        if held is not None and not rec.holds(held):
            return (f"its file {rec.path} in {folder} holds snapshot {held or '(none: it is no checkpoint)'}, not "
                    f"{rec.snapshot}: another writer's")
    return ""


def file_snapshot(name: str, folder_fd: int) -> str:
    """The snapshot identity (``FileHeader.snapshot``) of checkpoint file ``name`` in a folder (its descriptor);
    "" for a file that is not a whole checkpoint, which no marker lists as a snapshot."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=folder_fd)
    try:
        return snapshot_in(fd, name)
    finally:
        os.close(fd)


def snapshot_in(fd: int, name: str) -> str:
    """The snapshot identity of the checkpoint file open at ``fd`` (not O_DIRECT; ``name`` for messages): that very
    file's, wherever its path points now; "" for a file that is not a whole checkpoint."""
    try:
        container, at = index_at(os.pread(fd, INDEX_AT, 0), name)
        _, header_len, header_hash = parse_preamble(os.pread(fd, PREAMBLE_SIZE, at), name, container)
        return header_snapshot(os.pread(fd, header_len, at + PREAMBLE_SIZE), header_hash, name)
    except DatastatesError:
        return ""


def _folders(root: str, depth: int) -> Iterator[str]:
    """``root`` and the folders down to ``depth`` below it, sorted: checkpoints sit near a root, never crawl a file system."""
    yield root
    if depth <= 0:
        return
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(".") and os.path.isdir(path):  # hidden: a version being written, never a tag
            yield from _folders(path, depth - 1)


def marker_paths(root: str, depth: int = 1) -> list[str]:
    """Every file named like a commit marker in ``root`` and ``depth`` folders down, whole or not."""
    if not os.path.isdir(root):
        return []
    return [path for folder in _folders(root, depth) for path in marker_names(folder)]


def marker_names(folder: str) -> list[str]:
    """The entries of ``folder`` named like a commit marker, sorted: names only, none opened."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [os.path.join(folder, n) for n in sorted(names) if is_marker_name(n)]


def untrusted_folder(folder: str) -> str:
    """Why folder ``folder`` must not be trusted to hold a commit marker, or anything below it ("" if it may).

    A folder that is a link, that another user owns, or that group or others may write can
    be made to hold anything, so nothing found in it, or reached through it, speaks for this user.
    """
    return _untrusted(folder, stat.S_ISDIR, "a folder")


def distrust(marker: str) -> str:
    """Why the commit marker at ``marker`` must not be trusted ("" if it may), as ssh's StrictModes judges a key file.

    A marker names the files a restore loads, so a marker, or a tag folder, that another
    user owns or can write could point this user's trainer at that user's files. It must be
    a regular file too: a FIFO named like a marker would block whoever opens it.
    """
    return _untrusted(marker, stat.S_ISREG, "a regular file") or untrusted_folder(os.path.dirname(marker))


def _untrusted(path: str, kind: Callable[[int], bool], what: str) -> str:
    me = os.geteuid()
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if not kind(st.st_mode):
        return f"{path} is not {what} (mode {stat.filemode(st.st_mode)})"
    if st.st_uid not in (me, 0):
        return f"{path} belongs to uid {st.st_uid}, not to this user (uid {me}) or root"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def trusted_marker(path: str, whole: bool = True) -> CommitMarker | None:
    """``read_marker(path)`` for a marker this user may trust (``distrust``); an untrusted one is logged and skipped.

    ``whole`` False: the marker as it reads, whether or not its files are all there (what a
    reader checking one file against its tag needs).
    """
    store = backend_for(path)
    if not store.trusts(path):
        return None
    return read_marker(path) if whole else store.read_marker(path)


def committed_tags(root: str, depth: int = 1, own_folder: bool = False,
                   accept: Callable[[str], bool] = lambda tag: True, strict: bool = False) -> list[CommittedTag]:
    """The committed tags in ``root`` and ``depth`` folders down, newest first (``CommitMarker.newness``).

    ``own_folder``: only tags whose marker is in a folder named after the tag (below
    ``root``, never ``root`` itself), the ones retention and the tier resume deal with.
    ``strict``: a marker object that cannot be read raises, rather than being skipped: the
    newest tag cannot be named without it (``newest``).
    """
    found = []
    for path, marker in backend_for(root).markers(root, depth, strict):
        if marker is None or os.path.basename(path) != marker_name(marker.tag) or not accept(marker.tag):
            continue
        tag = CommittedTag(marker.tag, os.path.dirname(path), marker)
        if own_folder and (not tag.own_folder or tag.folder == root.rstrip("/")):
            continue
        found.append(tag)
    return sorted(found, key=lambda c: c.marker.newness, reverse=True)


def file_commits(path: str, depth: int = 3, roots: Sequence[str] | None = None) -> list[tuple[str, CommitMarker, MarkerFile]]:
    """Is this file committed? (marker path, marker, its entry) for every commit marker in the ``depth`` folders above
    ``path`` that lists it; whether the file there now is the one listed is its entry's to say (``MarkerFile.holds``).

    A tag's marker sits in its tag folder, at or above its files: this is how a reader
    given only a file's path finds what its tag says the file must be. Only where a marker
    of this user's can be: the climb stops at the first folder this user may not trust
    (``untrusted_folder``: ``/tmp`` above the root ``/tmp/ckpt``, say), and a marker there
    or above it, or one that fails ``distrust``, is never read.

    ``roots`` (the daemon's guards: refusing a save over a committed file, keeping a file
    a marker lists) turns that round: a guard must see more markers, not fewer, so every
    marker by name (read without blocking) in the folders at or below one of ``roots``
    counts, whatever its folder's trust (a setgid 2775 run folder, one made under umask
    002); the climb still stops at a root, so a marker planted above one changes nothing.
    """
    return backend_for(path).commits_of(path, depth, roots)


def next_sequence(run: str) -> int:
    """The sequence a new commit in folder ``run`` gets: one past the highest committed there."""
    return 1 + max((c.marker.sequence for c in committed_tags(run)), default=0)


def newest(root: str, depth: int = 1) -> CommittedTag | None:
    """The newest committed tag under ``root``, or None; StorageError where one of its marker objects cannot be read,
    which might be the newest."""
    tags = committed_tags(root, depth, strict=True)
    return tags[0] if tags else None
