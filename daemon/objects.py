"""Object store tiers: their check at start, the commit of a tag transferred there, and their retention.

A tag's objects are uploaded by the tier transfers (daemon/tiers.py) through the S3 writer
(daemon/storage/s3.py), ``PARTS_AT_ONCE`` parts at a time on threads of their own, so the
network never holds up the fast tier's flush threads. Then ``commit``: one listing of the
tag's folder proves every object complete at its size, and only then the marker object is
PUT, then the trackers, then that tier's ``keep_last``. An object store has no rename: the
marker's PUT is the one step that makes the tag committed there, and a reader (protocol/tags.py)
takes a tag as committed only if its marker lists objects that all are there at their sizes.

Retention deletes a tag's marker first (the tag is then invisible), then its objects.

Multi-node jobs: not on an object store tier yet (each node would need node 0 to gather its
done marker there, as on a shared file system); their transfers fail with that reason.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from datastates.protocol.descriptors import Tier
from datastates.protocol.errors import StorageError
from datastates.protocol.format import marker_name
from datastates.protocol.objectstore import is_object, list_keys
from datastates.protocol.tags import committed_tags

from .commit import make_marker, trackers
from .events import CommitEvent
from .storage.s3 import S3Writer

log = logging.getLogger(__name__)

PARTS_AT_ONCE = 8
"""Parts of one file uploaded at a time: each holds a 16 MiB buffer, 128 MiB in all."""
PROBE = ".datastates-probe-"


class ObjectTiers:
    """The object store tiers of the node config; owned by the tier transfers."""

    def __init__(self, tiers: list[Tier], owner: str) -> None:
        self.tiers = [t for t in tiers if is_object(t.path)]
        self._owner = owner
        self.writer = S3Writer(owner=owner)
        self.problems: dict[str, str] = {}
        """Tier name → why its start-up check failed (shown in status); transfers there are still tried."""
        self.checked = not self.tiers
        """Whether that check is over (status says it is under way until then)."""
        self._threads = ThreadPoolExecutor(PARTS_AT_ONCE, thread_name_prefix="ds-upload") if self.tiers else None

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Where a part upload (or any other object store call) runs: not on the flush threads."""
        assert self._threads is not None
        return self._threads.submit(fn, *args)

    def check(self) -> None:
        """Once at start: each tier's bucket exists and this daemon may write and delete there (a probe object)."""
        for tier in self.tiers:
            probe = f"{tier.path.rstrip('/')}/{PROBE}{self._owner}"
            try:
                self.writer.publish(probe, b"datastates start-up check")
                self.writer.remove(probe)
            except StorageError as exc:
                self.problems[tier.name] = exc.message
                log.error("storage tier %s (%s) cannot be written: %s; tags committed on faster tiers stay there",
                          tier.name, tier.path, exc.message)
        self.checked = True

    def begin(self, lower: CommitEvent, tier: Tier) -> None:
        """Before any byte of ``lower`` is uploaded to ``tier``: StorageError where it cannot go there at all; and the
        marker of an earlier version of the tag deleted, so that no reader takes the tag as committed while its
        objects are replaced one by one (a tag saved again): it is uncommitted there until its new marker."""
        if lower.ranks.num_nodes > 1:
            raise StorageError(f"tier {tier.name}: a job of {lower.ranks.num_nodes} nodes cannot commit to an object "
                               "store tier yet (docs/deploy.md)", path=tier.path)
        self.writer.remove(f"{os.path.dirname(next(iter(lower.files)))}/{marker_name(lower.tag)}")

    def commit(self, lower: CommitEvent, tier: Tier, keep_last: int | None, spare: set[str]) -> list[str]:
        """Commit ``lower`` (its objects uploaded) on ``tier``: the marker last; then retention. The tag folders pruned."""
        folder = os.path.dirname(next(iter(lower.files)))
        sizes = dict(list_keys(folder))
        for path, size in lower.files.items():
            if sizes.get(path) != size:
                raise StorageError(f"tier {tier.name}: tag {lower.tag!r} not committed: {path} is "
                                   f"{'missing' if path not in sizes else f'{sizes[path]} bytes, not {size}'}", path=path)
        marker = make_marker(lower.tag, lower.files, folder, lower.requested_ns, lower.sequence,
                             snapshots=lower.snapshots)
        self.writer.publish(f"{folder}/{marker_name(lower.tag)}", marker.encode())
        for tracker, data in trackers(lower.tag, folder).items():
            self.writer.publish(tracker, data)
        return self.prune(os.path.dirname(folder), keep_last, spare) if keep_last is not None else []

    def prune(self, run: str, keep_last: int, spare: set[str]) -> list[str]:
        """Delete the committed tags of ``run`` older than its ``keep_last`` newest: each one's marker, then its objects."""
        gone = []
        for tag in committed_tags(run, own_folder=True)[keep_last:]:
            if tag.tag in spare:
                continue
            try:
                self.writer.remove(tag.marker_path)
                for url, _ in list(list_keys(tag.folder)):
                    self.writer.remove(url)
            except StorageError as exc:
                log.warning("keep_last: cannot delete tag %s from %s: %s", tag.tag, run, exc.message)
                continue
            gone.append(tag.folder)
        return gone

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
