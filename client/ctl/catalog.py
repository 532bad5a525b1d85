"""What ``datastatesctl ls`` shows: every tag folder under a root, with its state, size, place and age."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from datastates.protocol.format import CommitMarker, marker_name
from datastates.protocol.storage import backend_for
from datastates.protocol.tags import committed_tags, tag_files


@dataclass(frozen=True)
class TagEntry:
    tag: str
    folder: str
    state: str
    """``committed`` (a valid marker), ``damaged`` (a marker whose files are missing or resized), or
    ``uncommitted`` (no marker: a save in flight, or one a crash left; never restored or pruned)."""
    size: int
    """Bytes on disk in the tag's folder (its files, its marker, anything else there): what deleting it frees."""
    files: int
    """A committed tag's: the files its marker lists (``tag_files``), as ``status`` counts them. Else every
    file in the folder."""
    age_s: float
    order_ns: int
    """When the commit was asked for, else the folder's last change: what ``ls`` sorts by, newest first."""
    in_memory: bool = False


def list_tags(root: str, in_memory: set[str] = frozenset()) -> list[TagEntry]:
    """The tag folders directly under ``root``, newest first; ``in_memory``: tags the daemon holds a replica of."""
    now = time.time()
    if not backend_for(root).mounted:
        return _object_tags(backend_for(root).absolute(root), now, in_memory)
    root = os.path.abspath(root)
    out = []
    committed = {c.folder: c.marker for c in committed_tags(root, own_folder=True)}
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if not os.path.isdir(folder) or name.startswith("."):
            continue
        on_disk = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
        size = sum(os.path.getsize(f) for f in on_disk if os.path.isfile(f))
        marker_path = os.path.join(folder, marker_name(name))
        marker = committed.get(folder)
        if marker is not None:
            files = tag_files(folder, marker)  # what status counts too
            state, age, order = "committed", now - marker.committed_ns / 1e9, marker.requested_ns or marker.committed_ns
        else:
            files = on_disk
            state = "damaged" if CommitMarker.read(marker_path) is not None else "uncommitted"
            mtime = os.path.getmtime(folder)
            age, order = now - mtime, int(mtime * 1e9)
        out.append(TagEntry(name, folder, state, size, len(files), age, order,
                            in_memory=state == "committed" and name in in_memory))
    return sorted(out, key=lambda e: e.order_ns, reverse=True)


def _object_tags(root: str, now: float, in_memory: set[str]) -> list[TagEntry]:
    """``list_tags`` of an object store folder, from one listing: objects with no marker are ``uncommitted``."""
    sizes: dict[str, list[int]] = {}
    for url, size in backend_for(root).list(root):
        name = url[len(root) + 1:].split("/", 1)[0]
        if "/" in url[len(root) + 1:] and not name.startswith("."):
            sizes.setdefault(name, []).append(size)
    committed = {c.tag: c.marker for c in committed_tags(root, own_folder=True)}
    out = []
    for name, found in sizes.items():
        marker = committed.get(name)
        state = "committed" if marker is not None else "uncommitted"
        age, order = (now - marker.committed_ns / 1e9, marker.requested_ns or marker.committed_ns) if marker else (0.0, 0)
        out.append(TagEntry(name, f"{root}/{name}", state, sum(found), len(marker.files) if marker else len(found),
                            age, order, in_memory=marker is not None and name in in_memory))
    return sorted(out, key=lambda e: e.order_ns, reverse=True)
