"""Object store tiers: their check at start, the commit of a tag transferred there, and their retention.

A tag's objects are uploaded by the tier transfers (daemon/tiers.py) through the object store backend
(protocol/storage/s3/), its parts by the upload process (daemon/uploader.py), so neither the
network nor the upload's CPU ever holds up the fast tier's flush threads or the daemon. Then ``commit``: one listing of the
tag's folder proves every object complete at its size, and only then the marker object is
PUT, then the trackers, then that tier's ``keep_last``. An object store has no rename: the
marker's PUT is the one step that makes the tag committed there, and a reader (protocol/tags.py)
takes a tag as committed only if its marker lists objects that all are there at their sizes.

Retention deletes a tag's marker first (the tag is then invisible), then its objects.

A job of several nodes commits there as on a shared file system (docs/format.md), with objects:
each node uploads its own files and PUTs its done marker object; node 0 lists the tag's
folder, one listing a look (50 ms apart, growing to 1 s), until every node's done marker is
there, reads them, checks every node's objects in one listing, and PUTs the tag's marker
listing them all, then deletes the done markers. The other nodes look for that marker (at
least ``(N - 1) / LOOKS_PER_S`` s apart); past ``commit_timeout`` a node deletes its done
marker and fails the transfer. Node 0 lists the done markers once more right before its PUT,
so a node that gave up before then is never committed; one that gives up in the few
milliseconds between is (an object store has no rename to close that window).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from datastates.protocol.descriptors import Tier
from datastates.protocol.errors import DatastatesError, StorageError
from datastates.protocol.format import done_name, is_marker_name, marker_name
from datastates.protocol.paths import within
from datastates.protocol.retention import prune
from datastates.protocol.storage import UploadedStorage, backend_class, backend_for

from .commit import make_marker
from .trackers import trackers
from .events import CommitEvent
from .gather import FIRST_LOOK_S, LONGEST_LOOK_S, LOOKS_PER_S
from .instances import daemons_folder
from .uploader import Uploader

log = logging.getLogger(__name__)

CALL_THREADS = 4
"""Threads of the object store calls other than part uploads: a tag's commit and an upload's start or end."""
PROBE = ".datastates-probe-"


class _Calls:
    """The threads of the object store calls: daemon threads, so that one left in a call to a hung server (each
    request tried TIMEOUT_TRIES times, READ_TIMEOUT_S each: protocol/storage/s3/) never holds the daemon's exit,
    as a ThreadPoolExecutor's, joined at exit, would. What such a call leaves undone, the upload journal and the next
    daemon's resume take up (protocol/storage/s3/, daemon/tiers.py). Used from the event loop's thread alone."""

    def __init__(self, threads: int) -> None:
        self._threads = threads
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._closed = False
        for n in range(threads):
            threading.Thread(target=self._work, name=f"ds-objects-{n}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        if self._closed:
            future.cancel()
        else:
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

    def close(self) -> None:
        """Calls not begun are cancelled; each thread ends once its call does."""
        self._closed = True
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._queue.get_nowait()
                if item is not None:
                    item[0].cancel()
        for _ in range(self._threads):
            self._queue.put(None)


class ObjectTiers:
    """The object store tiers of the node config; owned by the tier transfers."""

    def __init__(self, tiers: list[Tier], owner: str, timeout: float, idle: bool = False) -> None:
        self.tiers = [t for t in tiers if isinstance(backend_for(t.path), UploadedStorage)]
        """The tiers whose storage takes files by upload (step 2 of the write sequence: protocol/storage/base.py)."""
        self._owner = owner
        self._timeout = timeout
        """``commit_timeout``: how long node 0 waits for the other nodes' done markers, and they for its marker."""
        self.uploader = Uploader(idle)
        self.writer: Any = backend_class(self.tiers[0].path)(owner=owner, journals=daemons_folder(),
                                                               uploader=self.uploader) if self.tiers else None
        """The tiers' storage, writing through the upload process (None: no such tier)."""
        self.problems: dict[str, str] = {}
        """Tier name → why its start-up check failed (shown in status); transfers there are still tried."""
        self.checked = not self.tiers
        """Whether that check is over (status says it is under way until then)."""
        self._calls = _Calls(CALL_THREADS) if self.tiers else None
        """The object store calls other than part uploads (an upload begun, completed or aborted; a tag's commit, its
        retention): at the daemon's own priority, so a busy trainer never starves a commit (node 0 gathering the
        other nodes' done markers within their ``commit_timeout``)."""

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Where any other object store call runs (``_calls``)."""
        assert self._calls is not None
        return self._calls.submit(fn, *args)

    def start(self) -> None:
        """Once at start, on the event loop's thread (the process dies with the thread that started it): the upload
        process, with the tiers' clients made; one that cannot start is a problem of each tier, shown in status."""
        try:
            self.uploader.start([(t.endpoint, t.region) for t in self.tiers])
        except OSError as exc:
            for tier in self.tiers:
                self.problems[tier.name] = f"cannot start the upload process: {exc}"
            log.error("cannot start the upload process (%s): uploads to object store tiers fail until it starts", exc)

    def check(self) -> None:
        """Once at start, after ``start``: each tier's bucket exists and this daemon may write and delete there (a
        probe object)."""
        try:
            for tier in self.tiers:
                probe = f"{tier.path.rstrip('/')}/{PROBE}{self._owner}"
                try:
                    self.writer.publish(probe, b"datastates start-up check")
                    self.writer.delete(probe)
                except DatastatesError as exc:
                    self.problems[tier.name] = exc.message
                    log.error("storage tier %s (%s) cannot be written: %s; tags committed on faster tiers stay there",
                              tier.name, tier.path, exc.message)
        finally:
            self.checked = True

    def begin(self, lower: CommitEvent) -> None:
        """Before any byte of ``lower`` is uploaded: the marker of an earlier version of the tag deleted, so that no
        reader takes the tag as committed while its objects are replaced one by one (a tag saved again): it is
        uncommitted there until its new marker. That version's objects the new one lacks go too, as the fast tier's
        exchange of versions drops them (daemon/resave.py): none stays readable by its address, with old bytes."""
        folder = os.path.dirname(next(iter(lower.files)))
        own_marker = f"{folder}/{marker_name(lower.tag)}"
        earlier = self.writer.read_marker(own_marker)
        self.writer.delete(own_marker)
        if earlier is None:
            return
        others = set()  # listed by another tag's marker in the same folder (a "best" saved into step1/): theirs
        for url, _ in self.writer.list(folder):
            name = url.rsplit("/", 1)[1]
            if is_marker_name(name) and name != marker_name(lower.tag):
                marker = self.writer.read_marker(url)
                others |= {f"{folder}/{f.path}" for f in marker.files} if marker is not None else set()
        for url in {f"{folder}/{f.path}" for f in earlier.files} - set(lower.files) - others:
            self.writer.delete(url)

    def commit(self, lower: CommitEvent, tier: Tier, keep_last: int | None, spare: set[str]) -> list[str]:
        """Commit ``lower`` (its objects uploaded) on ``tier``: the marker last; then retention. The tag folders pruned."""
        folder = os.path.dirname(next(iter(lower.files)))
        tag, ranks = lower.tag, lower.ranks
        files, snapshots = lower.files, lower.snapshots
        self._check_own(folder, lower, tier)
        if ranks.num_nodes > 1:
            if os.path.basename(folder) != tag:
                raise StorageError(f"tier {tier.name}: tag {tag!r}: in a multi-node job a tag's files must live under "
                                   f"a folder named {tag!r}", path=folder)
            mine = make_marker(tag, files, folder, lower.requested_ns, lower.sequence, ranks.num_nodes,
                               ranks.node_rank, snapshots)
            self.writer.publish(f"{folder}/{done_name(tag, ranks.node_rank)}", mine.encode())
            if ranks.node_rank != 0:
                self._await_marker(folder, lower, tier)
                return []
            files, snapshots = self._gather(folder, lower, tier)
        _check_sizes(self.writer, folder, files, tier, tag)
        if ranks.num_nodes > 1:
            done = {f"{folder}/{done_name(tag, k)}": -1 for k in range(ranks.num_nodes)}
            _check_sizes(self.writer, folder, done, tier, tag)
        marker = make_marker(tag, files, folder, lower.requested_ns, lower.sequence, ranks.num_nodes,
                             snapshots=snapshots)
        self.writer.publish(f"{folder}/{marker_name(tag)}", marker.encode())
        try:  # committed: what follows only tidies, and a failure of it is logged, never the commit's
            for k in range(ranks.num_nodes if ranks.num_nodes > 1 else 0):
                self.writer.delete(f"{folder}/{done_name(tag, k)}")
            run = os.path.dirname(folder)
            if os.path.basename(folder) != tag or not within(run, tier.path):
                return []  # files with no folder of their own: no run folder of theirs to track or prune in
            for tracker, data in trackers(tag, folder).items():
                self.writer.publish(tracker, data)
            return self.prune(run, keep_last, spare) if keep_last is not None else []
        except DatastatesError as exc:
            log.warning("tag %s committed on tier %s, but its trackers or retention failed: %s", tag, tier.name,
                        exc.message)
            return []

    def _check_own(self, folder: str, lower: CommitEvent, tier: Tier) -> None:
        """Each object this node uploaded for ``lower`` is still the one its upload made (by ETag): another writer of
        the same keys (a job saving the same path, another node's stale transfer) fails the commit, never
        has its bytes committed as this tag's."""
        path = self.writer.replaced(folder, lower.files)
        if path:
            raise StorageError(f"tier {tier.name}: tag {lower.tag!r} not committed: {path} is not the object this "
                               "daemon uploaded (another writer replaced it)", path=path)

    def _gather(self, folder: str, lower: CommitEvent, tier: Tier) -> tuple[dict[str, int], dict[str, str]]:
        """Node 0: every node's files and snapshots, from their done markers, once all are there."""
        nodes, tag = lower.ranks.num_nodes, lower.tag
        names = {done_name(tag, k): k for k in range(nodes)}
        deadline, pause = time.monotonic() + self._timeout, FIRST_LOOK_S
        while True:
            there = {url.rsplit("/", 1)[1] for url, _ in self.writer.list(folder)}
            missing = sorted(k for name, k in names.items() if name not in there)
            if not missing:
                break
            if time.monotonic() > deadline:
                raise StorageError(f"tier {tier.name}: tag {tag!r} not committed: node(s) {missing[:16]} did not "
                                   f"upload their files within {self._timeout:.0f} s", path=folder)
            time.sleep(pause)
            pause = min(pause * 1.5, LONGEST_LOOK_S)
        files: dict[str, int] = {}
        snapshots: dict[str, str] = {}
        for name, k in names.items():
            done = self.writer.read_marker(f"{folder}/{name}")
            if done is None or done.tag != tag or done.node != k or done.sequence != lower.sequence:
                raise StorageError(f"tier {tier.name}: tag {tag!r} not committed: {folder}/{name} is not node {k}'s "
                                   "done marker of this commit", path=folder)
            for f in done.files:  # each a file of the tag's folder (``read_marker``)
                files[f"{folder}/{f.path}"] = f.size
                snapshots[f"{folder}/{f.path}"] = f.snapshot
        return files, snapshots

    def _await_marker(self, folder: str, lower: CommitEvent, tier: Tier) -> None:
        """A node other than 0: until node 0 has committed the tag; past ``commit_timeout`` its done marker is taken
        back and the transfer fails."""
        nodes, tag = lower.ranks.num_nodes, lower.tag
        floor = (nodes - 1) / LOOKS_PER_S
        deadline, pause = time.monotonic() + self._timeout, max(FIRST_LOOK_S, floor) * (0.5 + random.random())
        while True:
            marker = self.writer.read_marker(f"{folder}/{marker_name(tag)}")
            if marker is not None and marker.tag == tag and marker.sequence == lower.sequence:
                return
            if time.monotonic() > deadline:
                self.writer.delete(f"{folder}/{done_name(tag, lower.ranks.node_rank)}")
                raise StorageError(f"tier {tier.name}: tag {tag!r} not committed: node 0 did not commit it within "
                                   f"{self._timeout:.0f} s", path=folder)
            time.sleep(pause)
            pause = max(floor, min(pause * 1.5, LONGEST_LOOK_S))

    def prune(self, run: str, keep_last: int, spare: set[str]) -> list[str]:
        """Delete the committed tags of ``run`` older than its ``keep_last`` newest: each one's marker, then its objects."""
        return prune(run, keep_last, spare)

    def close(self) -> None:
        if self._calls is not None:
            self._calls.close()
        self.uploader.close()


def _check_sizes(writer: UploadedStorage, folder: str, files: dict[str, int], tier: Tier, tag: str) -> None:
    """Every object of ``files`` is in ``folder`` (one listing) at its size (-1: any); else StorageError."""
    sizes = dict(writer.list(folder))
    for path, size in files.items():
        if path not in sizes or size not in (-1, sizes[path]):
            raise StorageError(f"tier {tier.name}: tag {tag!r} not committed: {path} is "
                               f"{'missing' if path not in sizes else f'{sizes[path]} bytes, not {size}'}", path=path)
