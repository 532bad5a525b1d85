"""Finding committed tags: the one scanner of commit markers, beside the format that defines them.

``latest()``, ``Client.restore``, retention (``keep_last``, ``prune``, ``CheckpointManager``),
``datastatesctl ls``/``verify`` and the tier resume after a restart all ask the same
question, "which tags under this root are committed, newest first", and all answer it here.
A tag is committed when its marker is whole and every file it lists has the size it
lists; anything else (a save in flight, a folder a crash left) is invisible to readers.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

from .errors import DatastatesError
from .format import (INDEX_AT, PREAMBLE_SIZE, CommitMarker, MarkerFile, header_snapshot, index_at, is_marker_name,
                     marker_name, parse_preamble)
from .storage import backend_for
from .paths import within

log = logging.getLogger(__name__)

MARKER_READS = 16
"""Marker objects read at once when a folder of an object store is scanned: half the client's connections."""
T = TypeVar("T")


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
    if not store.mounted:
        return _object_marker(path, dict(store.list(os.path.dirname(path))))
    marker = CommitMarker.read(path)
    if marker is None or unlisted(os.path.dirname(path), marker):
        return None
    return marker


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
    return [path for folder in _folders(root, depth) for path in _marker_names(folder)]


def _marker_names(folder: str) -> list[str]:
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
    if not backend_for(path).mounted:  # who may write the bucket is its policy's to say
        return read_marker(path) if whole else read_marker_object(path)
    if not os.path.lexists(path):  # no tag committed here (a new node's fast tier, an interrupted save): no warning
        return None
    why = distrust(path)
    if why:
        log.warning("skipping the commit marker %s: %s", path, why)
        return None
    return read_marker(path) if whole else CommitMarker.read(path)


def committed_tags(root: str, depth: int = 1, own_folder: bool = False,
                   accept: Callable[[str], bool] = lambda tag: True, strict: bool = False) -> list[CommittedTag]:
    """The committed tags in ``root`` and ``depth`` folders down, newest first (``CommitMarker.newness``).

    ``own_folder``: only tags whose marker is in a folder named after the tag (below
    ``root``, never ``root`` itself), the ones retention and the tier resume deal with.
    ``strict``: a marker object that cannot be read raises, rather than being skipped: the
    newest tag cannot be named without it (``newest``).
    """
    if not backend_for(root).mounted:
        return _committed_objects(root, depth, own_folder, accept, strict)
    found = []
    for path in marker_paths(root, depth):
        marker = trusted_marker(path)
        if marker is None or os.path.basename(path) != marker_name(marker.tag) or not accept(marker.tag):
            continue
        tag = CommittedTag(marker.tag, os.path.dirname(path), marker)
        if own_folder and (not tag.own_folder or tag.folder == root.rstrip("/")):
            continue
        found.append(tag)
    return sorted(found, key=lambda c: c.marker.newness, reverse=True)


def safe_name(path: str) -> bool:
    """Whether a marker's file entry names an object inside the marker's folder: a relative key, no '.', '..' or
    empty part (an object store resolves none of them: ``a/../b`` is a key of its own)."""
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in path.split("/"))


def read_marker_object(path: str) -> CommitMarker | None:
    """The marker (or done marker) object at ``path`` as it reads, or None: absent, not a marker, or listing a file
    outside its folder."""
    raw = backend_for(path).read(path)
    try:
        marker = CommitMarker.decode(raw) if raw is not None else None
    except (ValueError, RecursionError, DatastatesError):
        return None
    return marker if marker is not None and all(safe_name(f.path) for f in marker.files) else None


def _object_marker(path: str, sizes: dict[str, int]) -> CommitMarker | None:
    """The marker object at ``path``, if whole and every object it lists is in ``sizes`` (one listing) at its size."""
    marker = read_marker_object(path)
    folder = os.path.dirname(path)
    if marker is None or any(sizes.get(f"{folder}/{f.path}") != f.size for f in marker.files):
        return None
    return marker


def _committed_objects(root: str, depth: int, own_folder: bool, accept: Callable[[str], bool],
                       strict: bool) -> list[CommittedTag]:
    """``committed_tags`` of an object store folder: one listing of it, and a GET of each marker object there, up to
    MARKER_READS at once (a run without ``keep_last`` holds a marker per save, each a round trip)."""
    root = root.rstrip("/")
    sizes = dict(backend_for(root).list(root))
    paths = [path for path in sizes if is_marker_name(path.rsplit("/", 1)[1])
             and path.rsplit("/", 1)[0][len(root):].count("/") <= depth]

    def read(path: str) -> CommitMarker | None:
        try:
            return _object_marker(path, sizes)
        except DatastatesError as exc:  # one marker refused (its own ACL, a key): the run's other tags still count
            if strict:
                raise
            log.warning("skipping the commit marker %s: %s", path, exc.message)
            return None

    markers = _on_daemon_threads(read, paths, MARKER_READS)
    found = []
    for path, marker in zip(paths, markers):
        folder, name = path.rsplit("/", 1)
        if marker is None or name != marker_name(marker.tag) or not accept(marker.tag):
            continue
        tag = CommittedTag(marker.tag, folder, marker)
        if own_folder and (not tag.own_folder or folder == root):
            continue
        found.append(tag)
    return sorted(found, key=lambda c: c.marker.newness, reverse=True)


def _on_daemon_threads(fn: Callable[[str], T], items: list[str], at_once: int) -> list[T]:
    """``fn`` of each of ``items``, ``at_once`` at a time, in order; the first error raised once the calls under way
    end, and no new one started after it. On daemon threads: one waiting on a hung server never holds the process at
    its exit, as a ThreadPoolExecutor's would (a restore goes on without that server, client/locate.py)."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = None if errors else next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=work, name="datastates-markers", daemon=True)
               for _ in range(min(at_once, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


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
    if not backend_for(path).mounted:  # a tag's objects lie in its own folder, its marker beside them
        folder = os.path.dirname(path)
        marker_path = f"{folder}/{marker_name(os.path.basename(folder))}"
        marker = read_marker_object(marker_path)
        entry = next((f for f in marker.files if f.path == os.path.basename(path)), None) if marker else None
        return [(marker_path, marker, entry)] if marker is not None and entry is not None else []
    out = []
    folder = os.path.dirname(os.path.abspath(path))
    for _ in range(depth):
        beyond = not any(within(folder, r) for r in roots) if roots is not None else untrusted_folder(folder)
        if beyond:
            break
        rel = os.path.relpath(path, folder)
        for marker_path in _marker_names(folder):
            marker = trusted_marker(marker_path, whole=False) if roots is None else CommitMarker.read(marker_path)
            entry = next((f for f in marker.files if f.path == rel), None) if marker is not None else None
            if entry is not None:
                out.append((marker_path, marker, entry))
        if os.path.dirname(folder) == folder:
            break
        folder = os.path.dirname(folder)
    return out


def next_sequence(run: str) -> int:
    """The sequence a new commit in folder ``run`` gets: one past the highest committed there."""
    return 1 + max((c.marker.sequence for c in committed_tags(run)), default=0)


def newest(root: str, depth: int = 1) -> CommittedTag | None:
    """The newest committed tag under ``root``, or None; StorageError where one of its marker objects cannot be read,
    which might be the newest."""
    tags = committed_tags(root, depth, strict=True)
    return tags[0] if tags else None
