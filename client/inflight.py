"""The snapshots and COMMITs a client has sent, or is about to, until settled; their fate when the daemon is lost.

Snapshots not yet known copied hold their captured tensors; COMMITs not yet answered hold
the caller's future; a snapshot another thread is about to send holds the fence
(``Expected``). When the daemon goes (killed, restarted, stalled past liveness), each
snapshot it had not claimed copied is given up (protocol/outcome.py), so the trainer may
change its tensors. With ``fallback="local"`` they are saved again in this process
(client/local_save.py) and their tags committed here. Without it, what the lost connection
had not committed is said lost once, and a tag part of which went with it fails its next
commit unless every file of it is saved again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterator

from datastates.protocol import messages as m
from datastates.protocol import outcome
from datastates.protocol.descriptors import CUDA_IPC, VM
from datastates.protocol.errors import CommitError, DaemonUnavailable, DatastatesError, WaitTimeout

from .capture import Capture
from .connection import Connection

log = logging.getLogger(__name__)


@dataclass(eq=False)
class SentSnapshot:
    """A snapshot the daemon has not yet been seen to copy: its captured tensors live until then."""

    ack: Future
    """The daemon's admission reply (a ``SnapshotAck``)."""
    msg: m.Snapshot
    capture: Capture


@dataclass(eq=False)
class SentCommit:
    """A COMMIT the daemon has not answered."""

    tag: str
    caller: Future
    """The future ``commit()`` returned."""
    reply: Future
    """The daemon's reply."""
    covered: list[SentSnapshot]
    """The tag's snapshots not yet copied when it was sent: a committed tag was copied whole."""


def _settle(caller: Future, reply: Future) -> None:
    """``caller`` resolved as ``reply`` was, once."""
    exc = reply.exception()
    _resolve(caller, reply.result() if exc is None else None, exc)


def _resolve(fut: Future, value: Any, exc: BaseException | None) -> None:
    """Resolve ``fut`` unless already done: the connection's thread and ``wait()`` may race to answer one COMMIT."""
    try:
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass


class Expected:
    """A snapshot another thread is about to send (``Client.expect``), which the fence waits for.

    The sender sends it inside ``sending()``; the fence either sees it sent (and then waits
    for its copy) or gives up first, after which ``sending()`` raises: a snapshot of tensors
    the trainer was let go to change is never taken. ``close()``: it will never be sent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._given_up = False

    @contextlib.contextmanager
    def sending(self) -> Iterator[None]:
        with self._lock:
            if self._given_up:
                raise WaitTimeout("the fence gave up waiting for this snapshot and let the trainer change its "
                                  "tensors: it is not taken")
            try:
                yield
            finally:
                self._done.set()

    def close(self) -> None:
        self._done.set()

    def wait_or_give_up(self, timeout: float) -> bool:
        """Whether it was sent (or will never be) within ``timeout`` s; if not, it may no longer be."""
        if self._done.wait(timeout):
            return True
        with self._lock:  # a send under way finishes first
            self._given_up = not self._done.is_set()
            return not self._given_up


class InFlight:
    """One client's snapshots and COMMITs its daemon has not settled, and the handling of that daemon's loss.

    ``lock`` guards the lists: ``snapshot()``, ``commit()`` and ``wait()`` run on the
    trainer's threads, and the daemon's replies arrive on the connection's thread.
    """

    def __init__(self, endpoint: str, fallback: str | None) -> None:
        self.endpoint = endpoint
        self.fallback = fallback
        self.lock = threading.Lock()
        self.uncopied: list[SentSnapshot] = []
        """Snapshots not yet known to be copied."""
        self.expected: list[Expected] = []
        """Snapshots another thread is about to send (``expect``): ``wait()`` waits for each to be set first."""
        self.commits: list[SentCommit] = []
        """COMMITs the daemon has not answered. With the local fallback, a tag whose snapshots ``wait()`` saves
        again locally is committed locally instead."""
        self.saver: Any = None
        """The in-process saver (client/local_save.py) once the fallback is in use."""
        self.waiting = False
        """Whether ``wait()`` runs: a COMMIT the lost daemon fails meanwhile may be one it commits locally."""
        self.left = False
        """Set once this client left a daemon it lost: without the fallback, the next call connects again."""
        self.lost: dict[str, set[str]] = {}
        """Tags part of which went with a daemon this client lost → the paths saved for them on that connection, not
        committed by it and not saved again since: committing the rest alone would make a partial tag."""
        self.decisions = ""
        """Where this client and the daemon agree on each snapshot's fate (protocol/outcome.py); the daemon removes it."""
        self.saved: dict[str, dict[str, str]] = {}
        """Tags snapshotted on this connection that no COMMIT it answered covers yet → their paths → the tickets."""
        self.unasked: set[str] = set()
        """Tags snapshotted on this connection since their last COMMIT was sent: no commit future would tell their loss."""

    def connecting(self, decisions: str) -> None:
        """A new connection, with its own decision folder: nothing is saved on it yet."""
        self.decisions, self.saved, self.unasked = decisions, {}, set()

    def sent(self, snap: SentSnapshot) -> None:
        """Record a snapshot the daemon was sent."""
        tag, path = snap.msg.tag, snap.msg.path
        with self.lock:
            self.uncopied.append(snap)
            self.saved.setdefault(tag, {})[path] = snap.msg.ticket
            self.unasked.add(tag)
            if path in self.lost.get(tag, ()):  # saved again: that part of the tag is whole once more
                self.lost[tag].discard(path)
                if not self.lost[tag]:
                    del self.lost[tag]

    def in_trainer(self) -> bool:
        """Whether a snapshot not yet copied is read from this process's own memory (GPU, CPU read in place)."""
        return any(any(d.kind in (CUDA_IPC, VM) for d in s.msg.sources) for s in self.uncopied)

    def clear(self) -> None:
        """Forget every snapshot: the daemon maps itself what it has not copied yet, so our segments may go."""
        with self.lock:
            self.uncopied = []

    def expect(self) -> Expected:
        """A snapshot another thread is about to send: ``wait()`` first waits until it is sent (``Client.expect``)."""
        coming = Expected()
        with self.lock:
            self.expected.append(coming)
        return coming

    def wait(self, conn: Connection, timeout: float | None, limit: float) -> None:
        """``Client.wait``: the expected snapshots sent within ``limit`` s (a save thread that failed never sends
        one), then every one copied. With the fallback, a lost daemon's snapshots are saved here again, and the
        COMMITs covering them committed here."""
        with self.lock:
            expected, self.expected = self.expected, []
        for i, coming in enumerate(expected):
            if not coming.wait_or_give_up(limit):
                with self.lock:
                    self.expected[:0] = expected[i + 1:]
                raise WaitTimeout(f"a snapshot expected from another thread (DCP's async_save) was not sent within "
                                  f"{limit} s: that save failed or hangs, and now fails if it tries to send it")
        if not self.uncopied:
            return
        pending = list(self.uncopied)
        saved: list[SentSnapshot] = []
        self.waiting = True
        try:
            self._wait_daemon(conn, pending, timeout)
        except DaemonUnavailable as exc:
            abandoned = self._give_up(pending)
            if abandoned:  # else the daemon had claimed every one copied: they are safe
                local = self.go_local(conn, self._abandoned(exc.message, abandoned))
                for snap in pending:  # unchanged since snapshot(): this is the fence
                    local.save(snap.msg, snap.capture.storages)
                saved = pending
            self._drop(pending)
        finally:
            self.waiting = False
            if self.commits:
                self._commit_locally(saved)

    def _wait_daemon(self, conn: Connection, pending: list[SentSnapshot], timeout: float | None) -> None:
        acks = [s.ack for s in pending]
        start = time.monotonic()
        if concurrent.futures.wait(acks, timeout).not_done:
            raise WaitTimeout(f"the daemon did not admit {len(acks)} snapshot(s) within {timeout} s")
        for s in pending:
            if s.ack.exception() is None and s.ack.result().skipped:
                log.warning("datastatesd skipped the snapshot of %s for tag %s: %s", s.msg.path, s.msg.tag,
                            s.ack.result().skipped)
        ids = [a.result().snapshot_id for a in acks if a.exception() is None and not a.result().skipped]
        if ids:
            fut = conn.request(m.Wait(snapshot_ids=ids))
            try:
                fut.result(None if timeout is None else max(0.0, timeout - (time.monotonic() - start)))
                for s in pending:  # claimed copied by the daemon: this client never gives up on them now
                    outcome.forget(self.decisions, s.msg.ticket)
            except TimeoutError:
                raise WaitTimeout(f"{len(ids)} snapshot(s) not copied by the daemon within {timeout} s") from None
            finally:
                if fut.done():  # copied or failed: either way reported once, by this wait
                    self._drop(pending)
        else:
            self._drop(pending)
        refused = next((a.exception() for a in acks if a.exception() is not None), None)
        if refused is not None:
            raise refused

    def commit(self, conn: Connection, tag: str) -> Future:
        """Send ``tag``'s COMMIT, failing it once where part of the tag went with a lost daemon."""
        with self.lock:
            covered = [s for s in self.uncopied if s.msg.tag == tag]
            saved, asked = self.saved, dict(self.saved.get(tag, {}))
            self.unasked.discard(tag)
            missing = sorted(self.lost.pop(tag, ()))  # fails this once: a save after it starts clean
        lost = (f"part of it was lost with the daemon this client lost ({len(missing)} file(s) saved through it and "
                f"not saved again since: {missing[:4]}); save it again whole") if missing else ""
        reply, caller = conn.request(m.Commit(tag=tag, lost=lost)), Future()
        with self.lock:
            self.commits.append(SentCommit(tag, caller, reply, covered))
        # the reply comes as the argument: a closure over ``reply`` would make a cycle that keeps ``covered``'s
        # tensors alive until the garbage collector runs
        reply.add_done_callback(lambda done: self._answer(tag, caller, done, covered, saved, asked))
        return caller

    def _answer(self, tag: str, caller: Future, reply: Future, covered: list[SentSnapshot],
                saved: dict[str, dict[str, str]], asked: dict[str, str]) -> None:
        """Pass the daemon's reply on, unless the daemon went away while snapshots of ``tag`` were not yet
        copied and the local fallback is on: then ``wait()`` saves them again and commits ``tag`` locally.

        A tag committed was copied whole: its snapshots' captured tensors go now, even if the
        trainer never calls ``wait()``, so a loop of ``snapshot()`` and ``commit()`` holds no
        more than the snapshots still in flight.
        """
        exc = reply.exception()
        if not isinstance(exc, DaemonUnavailable):  # the daemon answered: the tag is no longer its to lose
            with self.lock:
                if saved.get(tag) == asked:  # unless saved again since the COMMIT was sent
                    saved.pop(tag, None)
        if exc is None:
            for s in covered:
                outcome.forget(self.decisions, s.msg.ticket)
            self._drop(covered)
        if isinstance(exc, DaemonUnavailable) and self.fallback == "local" and (
                self.waiting or any(s.msg.tag == tag for s in list(self.uncopied))):
            return
        with self.lock:
            self.commits = [c for c in self.commits if c.caller is not caller]
        _settle(caller, reply)

    def _commit_locally(self, saved: list[SentSnapshot]) -> None:
        """Answer the COMMITs the daemon never will: locally those covering a snapshot ``saved`` here again, as it
        failed for the others.

        An earlier COMMIT of a tag saved here again covered only snapshots the daemon held:
        it fails, since the daemon never commits for a trainer that went local (``wanted``
        in daemon/commit.py). Committing the newer local save in its name would tell the
        trainer that step is committed when another one is (the fault schedules, seed 92861).
        """
        here, tags = set(saved), {s.msg.tag for s in saved}
        with self.lock:
            waiting, self.commits = self.commits, []
        for c in waiting:
            if c.caller.done():
                continue
            if any(s in here for s in c.covered):  # its snapshots are now saved here: the tag is ours to commit
                try:
                    _resolve(c.caller, self.saver.commit(c.tag), None)
                except DatastatesError as exc:
                    _resolve(c.caller, None, exc)
            elif c.tag in tags:
                _resolve(c.caller, None, CommitError(
                    f"tag {c.tag!r} not committed: datastatesd was lost while committing it, and never commits for a "
                    "trainer that saves on its own now (fallback='local'); a later save of it is committed here",
                    tag=c.tag))
            elif c.reply.done():
                _settle(c.caller, c.reply)
            else:  # the lost connection fails it in a moment; ``_answer`` passes that on
                with self.lock:
                    self.commits.append(c)

    def _drop(self, done: list[SentSnapshot]) -> None:
        """Forget snapshots known copied (or failed): their captured tensors may go now."""
        gone = set(done)
        with self.lock:  # only those still listed: ``covered`` and ``pending`` may both hold one
            for s in (s for s in self.uncopied if s in gone):
                s.capture.give_back()
            self.uncopied = [s for s in self.uncopied if s not in gone]

    def _give_up(self, pending: list[SentSnapshot]) -> list[str]:
        """Claim every snapshot in ``pending`` abandoned; the paths of those the daemon had not claimed copied first.

        From here on the daemon can never write an abandoned snapshot, however long it was
        stalled: the trainer may now change its tensors (invariant I3).
        """
        abandoned = [s.msg.path for s in pending
                     if outcome.decide(self.decisions, s.msg.ticket, outcome.ABANDONED) == outcome.ABANDONED]
        if not abandoned:
            log.warning("datastatesd at %s was lost; it had copied every pending snapshot, and writes them if it "
                        "comes back", self.endpoint)
        return abandoned

    def _abandoned(self, why: str, abandoned: list[str], untold: list[str] = ()) -> DaemonUnavailable:
        """The one report of a lost daemon: ``why``, the snapshots given up (``_give_up``), and the tags saved and not
        yet committed that no commit future tells of (``untold``)."""
        said = [why]
        if abandoned:
            said.append(f"{len(abandoned)} snapshot(s) not yet copied are abandoned, the daemon will never write them: "
                        f"{abandoned[:4]}")
        if untold:
            said.append(f"tag(s) {untold[:4]} saved and not committed are lost with it: a commit of one fails unless "
                        "every file saved for it is saved again first")
        return DaemonUnavailable("; ".join(said), endpoint=self.endpoint)

    def local_saver(self, conn: Connection) -> Any:
        """The in-process saver, switched to now where the fallback is on and the connection's thread found the
        daemon gone; None while the daemon saves."""
        if conn.lost and self.saver is None and self.fallback == "local":
            self.go_local(conn, DaemonUnavailable(f"datastatesd at {self.endpoint} was found gone",
                                                  endpoint=self.endpoint))
        return self.saver

    def go_local(self, conn: Connection, exc: DaemonUnavailable) -> Any:
        """Leave the daemon, then switch to local saves for good, or raise ``exc`` if the fallback is off (the next
        call then connects again, as a new client)."""
        self._leave(conn)
        if self.fallback != "local":
            raise exc
        log.warning("%s; fallback='local': checkpoints are now written synchronously by the trainer", exc.message)
        from .local_save import LocalSaver  # the one client module that imports the daemon: the fallback only

        self.saver = LocalSaver()
        return self.saver

    def _leave(self, conn: Connection) -> list[str]:
        """Leave this connection's daemon for good: a resumed daemon lets this client go instead of waiting on its
        pid, and writes nothing more for it (protocol/outcome.py). The tags it had not committed are lost with it;
        returns those no COMMIT was sent for since their last snapshot, so no commit future tells of them."""
        conn.close()
        outcome.leave(self.decisions, local=self.fallback == "local")
        self.left = True
        with self.lock:
            for tag, paths in self.saved.items():
                self.lost.setdefault(tag, set()).update(paths)
            untold, self.saved, self.unasked = sorted(self.unasked), {}, set()
        return untold

    def found_gone(self, conn: Connection) -> None:
        """Leave a daemon the connection's thread found gone, before connecting again as a new client.

        What the lost connection had not committed is lost with it, and said once: by the
        ``wait()`` or the commit future that met the loss; snapshots not waited for yet are
        given up here, and this call raises instead of that ``wait()``, as it does for tags
        saved (even copied) with no COMMIT sent since. A later commit of a tag part of which
        was lost fails once, unless every file saved for it on the lost connection was saved
        again (``lost``): committing only the files saved since would make a partial tag.
        The first connection's daemon was told this client left (protocol/outcome.py), so it
        releases what it held for it and never writes what was given up.
        """
        if not self.left:  # the I/O thread met the loss; no call has said so yet
            pending = list(self.uncopied)
            abandoned = self._give_up(pending) if pending else []
            self._drop(pending)
            untold = self._leave(conn)
            if abandoned or untold:  # copied but never committed is lost too: the trainer must not think it saved
                raise self._abandoned(f"datastatesd at {self.endpoint} was found gone", abandoned, untold)
