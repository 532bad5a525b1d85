"""Commit markers on an object store: their scan, a tag's files, retention.

The scan is one listing of the folder. A reader checks the marker again once it has read a file (``unchanged``): an
object store has no rename, so a tag saved again is replaced object by object.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Callable, Sequence, TypeVar

from ...errors import CorruptCheckpointError, DatastatesError, InvalidRequestError
from ...fanout import map_on_threads
from ...format import TRACKER, CommitMarker, MarkerFile, check_tag, is_marker_name, marker_name
from ...tags import CommittedTag, tag_files, trusted_marker

log = logging.getLogger(__name__)
T = TypeVar("T")

MARKER_READS = 16
"""Marker objects read at once when a folder of an object store is scanned: half the client's connections."""


class ObjectMarkers:
    """The commit-marker half of ``S3Storage`` (protocol/storage/s3/__init__.py), over its ``read``, ``list`` and
    ``delete``."""

    def read_marker(self, path: str) -> CommitMarker | None:
        """Not a marker either where it lists a file outside its folder (``safe_name``)."""
        raw = self.read(path)
        try:
            marker = CommitMarker.decode(raw) if raw is not None else None
        except (ValueError, RecursionError, DatastatesError):
            return None
        return marker if marker is not None and all(safe_name(f.path) for f in marker.files) else None

    def whole(self, folder: str, marker: CommitMarker, sizes: dict[str, int] | None = None) -> bool:
        """``sizes``: one listing of ``folder`` made already."""
        sizes = dict(self.list(folder)) if sizes is None else sizes
        return not any(sizes.get(f"{folder}/{f.path}") != f.size for f in marker.files)

    def trusts(self, path: str) -> bool:
        return True  # who may write the bucket is its policy's to say

    def markers(self, root: str, depth: int, strict: bool) -> list[tuple[str, CommitMarker | None]]:
        """One listing of ``root``, and a GET of each marker object there, up to MARKER_READS at once (a run without
        ``keep_last`` holds a marker per save, each a round trip)."""
        root = root.rstrip("/")
        sizes = dict(self.list(root))
        paths = [path for path in sizes if is_marker_name(path.rsplit("/", 1)[1])
                 and path.rsplit("/", 1)[0][len(root):].count("/") <= depth]

        def read(path: str) -> CommitMarker | None:
            try:
                marker = self.read_marker(path)
                return marker if marker is not None and self.whole(path.rsplit("/", 1)[0], marker, sizes) else None
            except DatastatesError as exc:  # one marker refused (its own ACL, a key): the run's other tags still count
                if strict:
                    raise
                log.warning("skipping the commit marker %s: %s", path, exc.message)
                return None

        return list(zip(paths, map_on_threads(lambda: nullcontext(read), paths, MARKER_READS, "datastates-markers")))

    def commits_of(self, path: str, depth: int, roots: Sequence[str] | None) -> list[tuple[str, CommitMarker,
                                                                                          MarkerFile]]:
        """A tag's objects lie in its own folder, its marker beside them."""
        folder = os.path.dirname(path)
        marker_path = f"{folder}/{marker_name(os.path.basename(folder))}"
        marker = self.read_marker(marker_path)
        entry = next((f for f in marker.files if f.path == os.path.basename(path)), None) if marker else None
        return [(marker_path, marker, entry)] if marker is not None and entry is not None else []

    def folders(self, root: str) -> list[tuple[str, str, int, int, int, bool]]:
        """From one listing: a folder's objects with no marker are ``uncommitted``, whatever they are."""
        sizes: dict[str, list[int]] = {}
        for url, size in self.list(root):
            name = url[len(root) + 1:].split("/", 1)[0]
            if "/" in url[len(root) + 1:] and not name.startswith("."):
                sizes.setdefault(name, []).append(size)
        return [(name, f"{root}/{name}", len(found), sum(found), 0, False) for name, found in sizes.items()]

    def files_at(self, target: str, skipped: Callable[[str, str], None]) -> list[str]:
        return self._files(target, named=False)

    def tag_files_named(self, root: str, tag: str, skipped: Callable[[str, str], None]) -> list[str]:
        return self._files(f"{root.rstrip('/')}/{tag}", named=True)

    def _files(self, target: str, named: bool) -> list[str]:
        """The objects a tag's marker object lists, or the object itself (``named``: the address is a tag's folder,
        named by the tag; never an object)."""
        folder = target.rstrip("/")
        name = os.path.basename(folder)
        try:
            marker = self.read_marker(f"{folder}/{marker_name(check_tag(name))}")
        except InvalidRequestError:  # not a tag's name: an object's
            marker = None
        if marker is not None:
            return tag_files(folder, marker)
        if named or next(self.list(folder), None) is not None:
            raise CorruptCheckpointError(f"no commit marker for {target!r} (no committed tag there)")
        return [target]

    def why_kept(self, tag: CommittedTag) -> str:
        try:
            return self._kept(tag, [url for url, _ in self.list(tag.folder)])
        except DatastatesError as exc:
            return exc.message

    def delete_tag(self, tag: CommittedTag, root: str) -> bool:
        """The marker object first (the tag is then not committed), then the objects. An object store has no rename:
        a delete cut short leaves objects without a marker (never a tag), which a lifecycle rule clears."""
        try:
            listed = [url for url, _ in self.list(tag.folder)]
            why = self._kept(tag, listed)
            if why:
                log.warning("not deleting checkpoint %s of %s: %s", tag.tag, tag.folder, why)
                return False
            self.delete(tag.marker_path)
            for url in listed:  # as listed before the guards: an object put there since is not this tag's
                if url != tag.marker_path:
                    self.delete(url)
        except DatastatesError as exc:  # a refusal, or a key no address can name (``a//b``): left as it is
            log.warning("cannot delete tag %s from %s: %s", tag.tag, root, exc.message)
            return False
        return True

    def _kept(self, tag: CommittedTag, listed: list[str]) -> str:
        """``kept`` of a tag whose folder holds ``listed``: a folder's guards (protocol/retention.py ``kept``) hold."""
        strangers = [url for url in listed if is_marker_name(url.rsplit("/", 1)[1]) and url != tag.marker_path]
        if strangers:
            return f"it also holds another tag's marker ({strangers[0].rsplit('/', 1)[1]})"
        if self.read_marker(tag.marker_path) != tag.marker:  # right before the delete: the window is a round trip
            return "it was committed again since it was listed, or its marker is gone"
        tracker = f"{tag.run}/{TRACKER}"
        if (self.read(tracker) or b"").decode(errors="replace").strip() == tag.tag:
            return f"the {TRACKER!r} tracker beside it names it"
        return ""

    def unchanged(self, folder: str, name: str, marker: CommitMarker) -> bool:
        """No rename here: a tag saved again has its objects replaced one by one, under no marker; so the marker is
        read again once the file is (the bucket just answered: an error is one)."""
        now = trusted_marker(os.path.join(folder, marker_name(marker.tag)))
        listed = next((f.snapshot for f in marker.files if f.path == name), None)
        return now is not None and now.sequence == marker.sequence and \
            next((f.snapshot for f in now.files if f.path == name), None) == listed

    def probe(self, fn: Callable[[str], T], place: str) -> Future:
        """On a daemon thread: one left waiting on a hung server never holds the process at its exit."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(place))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

        threading.Thread(target=run, name="datastates-tier-probe", daemon=True).start()
        return future

    def unreachable(self, exc: DatastatesError) -> bool:
        return True  # a server down or refusing: another tier may hold the same tag


def safe_name(path: str) -> bool:
    """Whether a marker's file entry names an object inside the marker's folder: a relative key, no '.', '..' or
    empty part (an object store resolves none of them: ``a/../b`` is a key of its own)."""
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in path.split("/"))
