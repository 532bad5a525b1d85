"""What ``datastatesctl ls`` shows: every tag folder under a root, with its state, size, place and age."""

from __future__ import annotations

import time
from dataclasses import dataclass

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
    store = backend_for(root)
    root = store.absolute(root)
    out = []
    committed = {c.folder: c.marker for c in committed_tags(root, own_folder=True)}
    for name, folder, count, size, changed_ns, marked in store.folders(root):
        marker = committed.get(folder)
        if marker is not None:
            count = len(tag_files(folder, marker))  # what status counts too
            state, age, order = "committed", now - marker.committed_ns / 1e9, marker.requested_ns or marker.committed_ns
        else:
            state = "damaged" if marked else "uncommitted"
            age, order = (now - changed_ns / 1e9 if changed_ns else 0.0), changed_ns
        out.append(TagEntry(name, folder, state, size, count, age, order,
                            in_memory=state == "committed" and name in in_memory))
    return sorted(out, key=lambda e: e.order_ns, reverse=True)
