"""Deciding whether a client may write a path: inside a root, after every symlink is followed."""

from __future__ import annotations

import os
import stat
import tempfile
from typing import Iterator, Sequence

from .descriptors import Tier
from .errors import PathNotAllowedError
from .format import (
    DELETING_RE,
    DONE_PREFIX,
    FILE_NAME_MAX,
    MARKER_PREFIX,
    MEGATRON_TRACKER,
    NAME_MAX,
    STAGING_NAME_MAX,
    TEMP_RESERVE,
    TEMP_SUFFIX,
    done_name,
    marker_name,
)

SHM_DIR = "/dev/shm"
"""Where trainers share CPU tensors with the daemon, and the daemon keeps its replicas."""
PATH_MAX = 4096
"""Linux's limit on a path handed to a system call, its terminating NUL byte included."""


def default_root() -> str:
    """The built-in checkpoint root: this user's own folder in the temp dir, which the daemon makes 0700."""
    return os.path.join(tempfile.gettempdir(), f"datastates-{os.getuid()}-ckpt")


def writable_by_others(path: str) -> str:
    """Why users other than ``path``'s owner can create or swap entries in folder ``path``; "" if they cannot."""
    st = os.stat(path)
    if st.st_mode & 0o002:
        return f"anyone may write in it (mode {stat.filemode(st.st_mode)})"
    if st.st_mode & 0o020:
        return f"its group may write in it (mode {stat.filemode(st.st_mode)})"
    if st.st_uid not in (0, os.geteuid()):
        return f"it belongs to uid {st.st_uid}"
    return ""


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def within(path: str, root: str) -> bool:
    """Whether ``path`` (resolved) is ``root`` or below it."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def home_tier(tiers: list[Tier], path: str) -> int | None:
    """The index of the tier ``path`` (resolved) lies in, if any."""
    return next((i for i, t in enumerate(tiers) if within(path, t.path)), None)


def shallow_walk(root: str, depth: int) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(root)`` down to ``depth`` folders below it: checkpoints sit near a root, never crawl a whole file system."""
    base = root.rstrip("/").count("/")
    for folder, dirs, files in os.walk(root):
        if folder.count("/") - base >= depth:
            dirs.clear()
        yield folder, dirs, files


def check_path(path: str, roots: list[str]) -> str:
    """The path a snapshot may be written to, or PathNotAllowedError saying why not."""
    def refuse(why: str) -> PathNotAllowedError:
        return PathNotAllowedError(f"path {path!r} refused: {why}", path=path[:PATH_MAX])

    if not os.path.isabs(path):
        raise refuse("it must be absolute")
    if len(path.encode()) > PATH_MAX:
        raise refuse(f"it is longer than {PATH_MAX} bytes")
    parts = path.split("/")
    if ".." in parts or "." in parts:
        raise refuse("it contains '.' or '..' components")
    if any(len(p.encode()) > NAME_MAX for p in parts):
        raise refuse(f"a component is longer than {NAME_MAX} bytes")
    if "\x00" in path:
        raise refuse("it contains a NUL byte")
    if any(DELETING_RE.fullmatch(p) for p in parts):
        raise refuse("a folder of it is named like a tag being deleted (.<tag>.<token>.dsdel), which the next prune deletes")
    name = os.path.basename(path)
    if not name or name.endswith(TEMP_SUFFIX) or name.startswith((MARKER_PREFIX, DONE_PREFIX)):
        raise refuse("the file name is empty or reserved for datastates' own files")
    if len(name.encode()) > FILE_NAME_MAX:
        raise refuse(f"its file name is {len(name.encode())} bytes, longer than {FILE_NAME_MAX}: each file is written "
                     f"under a temporary name first, which adds up to {TEMP_RESERVE} bytes to it")
    if os.path.islink(path):
        raise refuse("it is a symbolic link")
    if os.path.isdir(path):
        raise refuse("it is a directory")
    existing = _nearest_existing(os.path.dirname(path))
    try:
        real = os.path.join(os.path.realpath(existing), os.path.relpath(os.path.dirname(path), existing))
    except OSError as exc:  # a link that went between realpath's lstat and its readlink
        raise refuse(f"a folder of it changed while it was checked ({exc.strerror})") from None
    real = os.path.normpath(real)
    if not any(within(real, root) for root in roots):
        raise refuse(f"it is outside the allowed roots {roots} (after resolving symlinks: {real})")
    return os.path.join(real, name)


def longest_derived(path: str, tag: str, node_rank: int = 0) -> int:
    """The longest path, in bytes, datastates may write or read for a snapshot of ``path`` in ``tag``.

    The tag's folder is the file's folder or one above it, and its marker, a node's done
    marker and the trackers beside it are written there (or one folder up); a re-save's
    staging folder stands in for the tag's folder under a name of its own; each file is
    written under a temporary name first. Which folder is the tag's depends on the tag's
    other files, so the bound takes the worst: the deepest folder, and the shortest of its
    names replaced by the longest staging name.
    """
    folder = os.path.dirname(path)
    names = [n.encode() for n in folder.split("/") if n]
    staged = len(folder.encode()) + max(0, STAGING_NAME_MAX - min(map(len, names), default=STAGING_NAME_MAX))
    written = max(len(os.path.basename(path).encode()), len(marker_name(tag).encode()),
                  len(done_name(tag, node_rank).encode()), len(MEGATRON_TRACKER))
    return staged + len("/") + written + TEMP_RESERVE


def check_derived(path: str, tag: str, node_rank: int = 0, tiers: Sequence[Tier] = ()) -> None:
    """Refuse ``path`` (PathNotAllowedError) when a name datastates derives from it, here or where its copy goes on
    a slower tier, would not fit in PATH_MAX: the file would commit, but its tag's marker could not be written or
    found, so no reader would see the tag."""
    home = home_tier(list(tiers), path)
    places = [(path, "")] + ([] if home is None else
                             [(t.place(path, tiers[home]), f" on tier {t.name!r}") for t in tiers[home + 1:]])
    longest, where = max((longest_derived(p, tag, node_rank), where) for p, where in places)
    if longest >= PATH_MAX:
        raise PathNotAllowedError(
            f"path {path!r} refused: it is {len(path.encode())} bytes, and the names datastates writes for it in tag "
            f"{tag!r}{where} (its marker, a re-save's staging copy, temporary names) may take {longest}, and a path "
            f"may have at most {PATH_MAX - 1} (PATH_MAX); use a shorter path", path=path[:PATH_MAX])
