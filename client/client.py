"""The thin client a training rank holds: capture, one message, and futures."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import os
import shutil
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from datastates.protocol import messages as m
from datastates.protocol import outcome
from datastates.protocol.descriptors import CUDA_IPC, VM, Ranks, Tier
from datastates.protocol.endpoint import resolve_endpoint
from datastates.protocol.errors import CommitError, DaemonUnavailable, DatastatesError, InvalidRequestError, WaitTimeout
from datastates.protocol.format import check_tag, marker_name
from datastates.protocol.storage import backend_for
from datastates.protocol.tags import trusted_marker
from datastates.protocol.liveness import pid_namespace, process_began_ns, process_start
from datastates.protocol.paths import check_derived, check_path

from .capture import Capture, capture, gc_paused
from .cuda import GpuRoute
from .connection import DEFAULT_LIVENESS, Connection, daemon_status  # noqa: F401  (daemon_status: re-exported)
from .inplace import Probe, allow_reader, yama_scope
from .shm import Staging
from .locate import again_if_deleted, locate
from .reader import MapLocation, load
from .ranks import ranks_from_env

DEFAULT_TIMEOUT = 30.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restored:
    """What ``Client.restore`` read: the tag, the file on storage it stands for, and where the bytes came from."""

    tag: str
    path: str
    source: str
    """``memory`` (the daemon's replica, through /dev/shm) or ``storage`` (the file at ``path``)."""
    state: Any
    why_not_memory: str = ""
    tier: str = ""
    """With ``storage.tiers``: the tier read (the fastest holding the tag committed)."""


@dataclass(frozen=True)
class SnapshotHandle:
    """What ``snapshot()`` returns: what the daemon will write, and its id once it has admitted it."""

    path: str
    tag: str
    ack: Future = field(repr=False, compare=False)

    @property
    def id(self) -> int:
        return self.ack.result().snapshot_id

    @property
    def nbytes(self) -> int:
        """Tensor bytes the daemon copies (a storage shared by views counts once)."""
        return self.ack.result().total_bytes

    @property
    def skipped(self) -> str:
        """Why the daemon skipped this snapshot under ``on_busy="skip"``; empty if it takes it."""
        return self.ack.result().skipped


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


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


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


class Client:
    """A connection from one training rank to its node's datastatesd.

    Call order: ``snapshot()`` any number of times, ``wait()`` before anything changes the
    checkpointed tensors in place (the optimizer step), then ``commit(tag)``.

    ``on_busy`` is what the daemon does with a new tag's snapshot while an older tag's is
    still being copied or written: ``"block"`` takes it, and its copy waits for host
    memory; ``"skip"`` drops the whole tag with a warning, so the trainer never waits on
    storage. ``fallback="local"`` saves synchronously in this process whenever the daemon
    cannot be reached, instead of raising DaemonUnavailable.

    ``cpu_capture`` is how the daemon gets CPU tensors. ``"auto"``: it reads them in place
    in this process (process_vm_readv) where it can, so a snapshot moves, maps and changes
    nothing here, and falls back to ``"shm"`` where it cannot (another pid namespace,
    ptrace forbidden). ``"shm"``: each snapshot copies the CPU storages into /dev/shm
    segments this client owns and reuses (a memcpy in ``snapshot()``), and the daemon maps
    them, so a snapshot survives this process's crash even before ``wait()``. ``in_place``
    says which one this client uses.

    ``gpu_capture`` is how the daemon gets CUDA tensors. ``"auto"``: it reads them through
    CUDA IPC, on its own streams, once the kernels queued before ``snapshot()`` are done,
    where a probe of one small tensor shows it can open this process's handles on that
    device; elsewhere the trainer copies them to /dev/shm in ``snapshot()``. ``"ipc"``: CUDA
    IPC or an error; ``"host"``: always the trainer's copy. ``gpu_capture_paths`` says
    which path each device took.
    """

    def __init__(
        self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT, name: str | None = None,
        liveness: float = DEFAULT_LIVENESS, on_busy: str = "block", fallback: str | None = None,
        ranks: Ranks | None = None, cpu_capture: str = "auto", gpu_capture: str = "auto",
    ) -> None:
        if on_busy not in m.ON_BUSY:
            raise InvalidRequestError(f"on_busy: {on_busy!r} is not one of {list(m.ON_BUSY)}")
        if cpu_capture not in ("auto", "shm"):
            raise InvalidRequestError(f"cpu_capture: {cpu_capture!r} is not 'auto' or 'shm'")
        if fallback not in (None, "local"):
            raise InvalidRequestError(f"fallback: {fallback!r} is not None or 'local'")
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout
        self.fallback = fallback
        self.ranks = (ranks or ranks_from_env()).check()
        if fallback and self.ranks.world_size > 1:
            raise InvalidRequestError("fallback='local' is for jobs of one rank: without their daemons, ranks cannot "
                                      "commit a tag together, and one rank's marker would name a partial tag")
        self.client_id = ""
        self.roots: list[str] = []
        self.tiers: list[Tier] = []
        self.in_place = False
        """Whether the daemon reads this process's CPU tensors in place (else through /dev/shm)."""
        self._probe = Probe() if cpu_capture == "auto" else None
        self._staging = Staging()
        self._gpu = GpuRoute(gpu_capture, self._staging, self._probe_cuda)
        self._local: Any = None
        """The in-process saver (datastates.daemon.local.LocalSaver) once the fallback is in use."""
        self._uncopied: list[tuple[Future, m.Snapshot, Capture]] = []
        """Snapshots not yet known to be copied: the daemon's admission reply, the message, the captured leaves."""
        self._commits: list[tuple[str, Future, Future, list[tuple[Future, m.Snapshot, Capture]]]] = []
        """COMMITs the daemon has not answered: (tag, the caller's future, the daemon's reply). With the local
        fallback, a tag whose snapshots ``wait()`` saves again locally is committed locally instead."""
        self._commits_lock = threading.Lock()
        self._reconnecting = threading.RLock()
        """Held while one thread finds the connection lost and makes a new one: a reader's threads restoring files
        at once (integrations/dcp.py) make one, not one each."""
        self._expected: list[Expected] = []
        """Snapshots another thread is about to send (``expect``): ``wait()`` waits for each to be set first."""
        self._waiting = False
        """Whether ``wait()`` runs: a COMMIT the lost daemon fails meanwhile may be one it commits locally."""
        self._tickets = itertools.count(1)
        self._name = name or f"pid{os.getpid()}"
        self._on_busy = on_busy
        self._liveness = liveness
        self._left = False
        """Set once this client left a daemon it lost: without the fallback, the next call connects again."""
        self._lost: dict[str, set[str]] = {}
        """Tags part of which went with a daemon this client lost → the paths saved for them on that connection, not
        committed by it and not saved again since: committing the rest alone would make a partial tag."""
        try:
            self._connect()
        except DaemonUnavailable as exc:
            self._go_local(exc)

    def _connect(self) -> None:
        """Say HELLO on a new connection, with a new decision folder: to the daemon, a new client.

        At construction, and again after a lost daemon (``_reconnect``): a daemon that was
        stalled past liveness, or restarted, does not know the old connection's client.
        """
        self._conn = Connection(self.endpoint, self._liveness)
        self._saved: dict[str, dict[str, str]] = {}
        """Tags snapshotted on this connection that no COMMIT it answered covers yet → their paths → the tickets."""
        self._unasked: set[str] = set()
        """Tags snapshotted on this connection since their last COMMIT was sent: no commit future would tell their loss."""
        self._decisions = outcome.make_folder()
        """Where this client and the daemon agree on each snapshot's fate (protocol/outcome.py); the daemon removes it."""
        hello = m.Hello(pid=os.getpid(), name=self._name, host=socket.gethostname(), on_busy=self._on_busy,
                        pidns=pid_namespace(), started=process_start(os.getpid()) or "", ranks=self.ranks,
                        began_ns=process_began_ns(os.getpid()),
                        decisions=self._decisions, probe=str(self._probe or ""))
        try:
            if self._probe is not None and yama_scope() == 1:  # the daemon is no ancestor: name it our reader first
                allow_reader(self._conn.call(m.Status(), self.timeout).status["daemon"]["pid"])
            welcome = self._conn.call(hello, self.timeout)
        except BaseException:
            # a daemon that welcomed it all the same (its WELCOME too late) takes the folder gone as this client gone
            shutil.rmtree(self._decisions, ignore_errors=True)
            self._conn.close()
            raise
        self._left = False
        self._conn.heartbeat = welcome.heartbeat_s
        self._conn.registered = True
        self.client_id = welcome.client_id
        self.roots = welcome.roots
        self.tiers = welcome.tiers
        for tier in self.tiers:
            backend_for(tier.path).connect(tier.path, tier.endpoint, tier.region)
        self.in_place = self._probe is not None and not welcome.vm_refused
        if self._probe is not None and welcome.vm_refused:
            log.info("datastatesd cannot read this process's memory in place (%s): CPU tensors go through %s",
                     welcome.vm_refused, "/dev/shm")

    @property
    def gpu_capture_paths(self) -> dict[int, str]:
        """Device index → "ipc", or "host: <why the daemon cannot open its handles>", for devices used so far."""
        return dict(self._gpu.paths)

    @property
    def cuda_shares(self) -> int:
        """CUDA storages shared with the daemon so far: once each for its lifetime, however many snapshots."""
        return self._gpu.blocks.shares

    def _probe_cuda(self, handle: str, expect: bytes) -> str:
        reply = self._conn.call(m.CudaProbe(handle=handle, expect=expect), self.timeout)
        return reply.refused

    @property
    def local(self) -> bool:
        """True once this client saves in its own process (``fallback="local"`` and no daemon)."""
        return self._local is not None

    def _go_local(self, exc: DaemonUnavailable) -> Any:
        """Leave the daemon, then switch to local saves for good, or raise ``exc`` if the fallback is off (the next
        call then connects again, as a new client)."""
        self._leave()
        if self.fallback != "local":
            raise exc
        log.warning("%s; fallback='local': checkpoints are now written synchronously by the trainer", exc.message)
        from datastates.daemon.local import LocalSaver  # the one client → daemon import: the fallback only

        self._local = LocalSaver()
        return self._local

    def snapshot(self, state: Any, path: str | os.PathLike, tag: str | None = None) -> SnapshotHandle:
        """Hand ``state`` to the daemon, to be written to ``path``; returns once the message is sent.

        The trainer pays for the tree walk and one message, never for a copy: the daemon
        admits and copies in the background, so tensors must not change in place until
        ``wait()`` returns. A path outside the daemon's roots is refused here; any other
        refusal is raised by the next ``wait()``. ``tag`` defaults to the parent folder's name.
        """
        path = os.path.abspath(os.fspath(path))
        tag = check_tag(tag if tag is not None else os.path.basename(os.path.dirname(path)))
        if self._conn.lost and self._local is None and self.fallback == "local":
            self._go_local(DaemonUnavailable(f"datastatesd at {self.endpoint} was found gone", endpoint=self.endpoint))
        if self._local is None:
            conn = self._daemon()  # before the capture: a new connection shares this process's GPU memory anew
            # the daemon checks both again; this makes the error immediate
            check_derived(check_path(path, self.roots), tag, self.ranks.node_rank, self.tiers)
        if self._local is not None:  # this process saves it: it reads every storage itself
            cap = capture(state)
            msg = m.Snapshot(path=path, tag=tag, sources=cap.sources, entries=cap.entries, root=cap.root)
            return SnapshotHandle(path=path, tag=tag, ack=_done(self._local.save(msg, cap.storages)))
        with gc_paused():
            cap = capture(state, None if self.in_place else self._staging, self._gpu)
            retired = self._gpu.blocks.take_retired()
            msg = m.Snapshot(path=path, tag=tag, sources=cap.sources, entries=cap.entries, root=cap.root,
                             ticket=str(next(self._tickets)), fences=cap.fences, retired=retired)
            try:
                ack = conn.request(msg)
            except BaseException:
                self._gpu.blocks.untake(retired)
                raise
        with self._commits_lock:
            self._uncopied.append((ack, msg, cap))
            self._saved.setdefault(tag, {})[path] = msg.ticket
            self._unasked.add(tag)
            if path in self._lost.get(tag, ()):  # saved again: that part of the tag is whole once more
                self._lost[tag].discard(path)
                if not self._lost[tag]:
                    del self._lost[tag]
        return SnapshotHandle(path=path, tag=tag, ack=ack)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the daemon holds its own copy of every snapshot taken so far.

        Raises the first failure among them (the daemon refused one, or could not copy
        it); each failure is reported by one ``wait()`` only.
        """
        with self._commits_lock:
            expected, self._expected = self._expected, []
        limit = timeout if timeout is not None else self.timeout  # a save thread that failed never sends it
        for i, coming in enumerate(expected):
            if not coming.wait_or_give_up(limit):
                with self._commits_lock:
                    self._expected[:0] = expected[i + 1:]
                raise WaitTimeout(f"a snapshot expected from another thread (DCP's async_save) was not sent within "
                                  f"{limit} s: that save failed or hangs, and now fails if it tries to send it")
        if not self._uncopied:
            return
        pending = list(self._uncopied)
        saved: dict[int, str] = {}
        self._waiting = True
        try:
            self._wait_daemon(pending, timeout)
        except DaemonUnavailable as exc:
            abandoned = self._give_up(pending)
            if abandoned:  # else the daemon had claimed every one copied: they are safe
                local = self._go_local(self._abandoned(exc.message, abandoned))
                for _ack, msg, cap in pending:  # unchanged since snapshot(): this is the fence
                    local.save(msg, cap.storages)
                saved = {id(x): x[1].tag for x in pending}
            self._drop(pending)
        finally:
            self._waiting = False
            if self._commits:
                self._commit_locally(saved)

    def _drop(self, done: list[tuple[Future, m.Snapshot, Capture]]) -> None:
        """Forget snapshots known copied (or failed): their captured tensors may go now."""
        gone = {id(x) for x in done}
        with self._commits_lock:  # only those still listed: ``covered`` and ``pending`` may both hold one
            for _ack, _msg, cap in (x for x in self._uncopied if id(x) in gone):
                cap.give_back()
            self._uncopied = [x for x in self._uncopied if id(x) not in gone]

    def _give_up(self, pending: list[tuple[Future, m.Snapshot, Capture]]) -> list[str]:
        """Claim every snapshot in ``pending`` abandoned; the paths of those the daemon had not claimed copied first.

        From here on the daemon can never write an abandoned snapshot, however long it was
        stalled: the trainer may now change its tensors (invariant I3).
        """
        abandoned = [msg.path for _, msg, _ in pending
                     if outcome.decide(self._decisions, msg.ticket, outcome.ABANDONED) == outcome.ABANDONED]
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

    def _leave(self) -> list[str]:
        """Leave this connection's daemon for good: a resumed daemon lets this client go instead of waiting on its
        pid, and writes nothing more for it (protocol/outcome.py). The tags it had not committed are lost with it;
        returns those no COMMIT was sent for since their last snapshot, so no commit future tells of them."""
        self._conn.close()
        outcome.leave(self._decisions, local=self.fallback == "local")
        self._left = True
        with self._commits_lock:
            for tag, paths in self._saved.items():
                self._lost.setdefault(tag, set()).update(paths)
            untold, self._saved, self._unasked = sorted(self._unasked), {}, set()
        return untold

    def _daemon(self) -> Connection:
        """The connection to the daemon: after one was lost (and no fallback), a new one, as a new client."""
        with self._reconnecting:
            if self.fallback is None and (self._left or self._conn.lost):
                self._reconnect()
            return self._conn

    def _reconnect(self) -> None:
        """Connect again to a daemon this client lost (stalled past liveness, restarted), as a new client.

        What the lost connection had not committed is lost with it, and said once: by the
        ``wait()`` or the commit future that met the loss; snapshots not waited for yet are
        given up here, and this call raises instead of that ``wait()``, as it does for tags
        saved (even copied) with no COMMIT sent since. A later commit of a tag part of which
        was lost fails once, unless every file saved for it on the lost connection was saved
        again (``_lost``): committing only the files saved since would make a partial tag. The first
        connection's daemon was told this client left (protocol/outcome.py), so it releases
        what it held for it and never writes what was given up. A daemon still away raises
        DaemonUnavailable here, and the next call tries again.
        """
        if not self._left:  # the I/O thread met the loss; no call has said so yet
            pending = list(self._uncopied)
            abandoned = self._give_up(pending) if pending else []
            self._drop(pending)
            untold = self._leave()
            if abandoned or untold:  # copied but never committed is lost too: the trainer must not think it saved
                raise self._abandoned(f"datastatesd at {self.endpoint} was found gone", abandoned, untold)
        lost = self.client_id
        self._gpu = GpuRoute(self._gpu.mode, self._staging, self._probe_cuda)  # the new client shares GPU memory anew
        self._connect()
        log.info("connected to datastatesd at %s again, as client %s (was %s): what the lost connection had not "
                 "committed is lost", self.endpoint, self.client_id, lost)

    def _wait_daemon(self, pending: list[tuple[Future, m.Snapshot, Capture]], timeout: float | None) -> None:
        acks = [ack for ack, _, _ in pending]
        start = time.monotonic()
        if concurrent.futures.wait(acks, timeout).not_done:
            raise WaitTimeout(f"the daemon did not admit {len(acks)} snapshot(s) within {timeout} s")
        for ack, msg, _ in pending:
            if ack.exception() is None and ack.result().skipped:
                log.warning("datastatesd skipped the snapshot of %s for tag %s: %s", msg.path, msg.tag, ack.result().skipped)
        ids = [a.result().snapshot_id for a in acks if a.exception() is None and not a.result().skipped]
        if ids:
            fut = self._conn.request(m.Wait(snapshot_ids=ids))
            try:
                fut.result(None if timeout is None else max(0.0, timeout - (time.monotonic() - start)))
                for _, msg, _ in pending:  # claimed copied by the daemon: this client never gives up on them now
                    outcome.forget(self._decisions, msg.ticket)
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

    def expect(self) -> Expected:
        """Say that another thread is about to snapshot tensors this one may change next (DCP's ``async_save``
        returns before its own thread plans the save and sends the snapshot): ``wait()``, and so the fence, first
        waits until that thread has sent it (``Expected.sending``), at most ``timeout`` (or this client's
        ``timeout``) seconds; then it raises WaitTimeout once, and the snapshot may no longer be sent."""
        coming = Expected()
        with self._commits_lock:
            self._expected.append(coming)
        return coming

    def protect(self, optimizer: torch.optim.Optimizer) -> Any:
        """Fence every ``optimizer.step()`` with ``wait()``, so a loop needs this one line.

        The step is the first in-place change of checkpointed state after forward and
        backward. An LR scheduler or a grad scaler that changes checkpointed state before
        the step needs its own ``wait()`` first. Returns the hook's removable handle.
        """
        return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.wait())

    def commit(self, tag: str) -> Future:
        """Mark ``tag`` committed once every file snapshotted for it is durable.

        The future's result is the daemon's ``Committed`` reply (tag, marker, files).
        """
        check_tag(tag)
        if self._local is not None:
            return _done(self._local.commit(tag))
        conn = self._daemon()
        with self._commits_lock:
            covered = [x for x in self._uncopied if x[1].tag == tag]
            saved, asked = self._saved, dict(self._saved.get(tag, {}))
            self._unasked.discard(tag)
            missing = sorted(self._lost.pop(tag, ()))  # fails this once: a save after it starts clean
        lost = (f"part of it was lost with the daemon this client lost ({len(missing)} file(s) saved through it and "
                f"not saved again since: {missing[:4]}); save it again whole") if missing else ""
        reply, caller = conn.request(m.Commit(tag=tag, lost=lost)), Future()
        with self._commits_lock:
            self._commits.append((tag, caller, reply, covered))
        # the reply comes as the argument: a closure over ``reply`` would make a cycle that keeps ``covered``'s
        # tensors alive until the garbage collector runs
        reply.add_done_callback(lambda done: self._answer(tag, caller, done, covered, saved, asked))
        return caller

    def _answer(self, tag: str, caller: Future, reply: Future, covered: list[tuple[Future, m.Snapshot, Capture]],
                saved: dict[str, dict[str, str]], asked: dict[str, str]) -> None:
        """Pass the daemon's reply on, unless the daemon went away while snapshots of ``tag`` were not yet
        copied and the local fallback is on: then ``wait()`` saves them again and commits ``tag`` locally.

        A tag committed was copied whole: its snapshots' captured tensors go now, even if the
        trainer never calls ``wait()``, so a loop of ``snapshot()`` and ``commit()`` holds no
        more than the snapshots still in flight.
        """
        exc = reply.exception()
        if not isinstance(exc, DaemonUnavailable):  # the daemon answered: the tag is no longer its to lose
            with self._commits_lock:
                if saved.get(tag) == asked:  # unless saved again since the COMMIT was sent
                    saved.pop(tag, None)
        if exc is None:
            for _ack, msg, _cap in covered:
                outcome.forget(self._decisions, msg.ticket)
            self._drop(covered)
        if isinstance(exc, DaemonUnavailable) and self.fallback == "local" and (
                self._waiting or any(msg.tag == tag for _, msg, _ in list(self._uncopied))):
            return
        with self._commits_lock:
            self._commits = [c for c in self._commits if c[1] is not caller]
        _settle(caller, reply)

    def _commit_locally(self, saved: dict[int, str]) -> None:
        """Answer the COMMITs the daemon never will: locally those covering a snapshot ``saved`` here again (the
        ``id`` of its ``_uncopied`` entry → its tag), as it failed for the others.

        An earlier COMMIT of a tag saved here again covered only snapshots the daemon held:
        it fails, since the daemon never commits for a trainer that went local (``wanted``
        in daemon/commit.py). Committing the newer local save in its name would tell the
        trainer that step is committed when another one is (the fault schedules, seed 92861).
        """
        with self._commits_lock:
            waiting, self._commits = self._commits, []
        for tag, caller, reply, covered in waiting:
            if caller.done():
                continue
            if any(id(x) in saved for x in covered):  # its snapshots are now saved here: the tag is ours to commit
                try:
                    _resolve(caller, self._local.commit(tag), None)
                except DatastatesError as exc:
                    _resolve(caller, None, exc)
            elif tag in saved.values():
                _resolve(caller, None, CommitError(
                    f"tag {tag!r} not committed: datastatesd was lost while committing it, and never commits for a "
                    "trainer that saves on its own now (fallback='local'); a later save of it is committed here",
                    tag=tag))
            elif reply.done():
                _settle(caller, reply)
            else:  # the lost connection fails it in a moment; ``_answer`` passes that on
                with self._commits_lock:
                    self._commits.append((tag, caller, reply, covered))

    def restore(self, root: str | os.PathLike, name: str, tag: str | None = None,
                map_location: MapLocation = None, *, into: Any = None, strict: bool = True,
                weights_only: bool = True) -> Restored | None:
        """Load this rank's file ``name`` of ``tag`` (default: the newest committed under ``root``).

        With ``into``, straight into its tensors, and ``Restored.state`` is ``into``
        (``datastates.load(path, into=...)``, with ``strict``): say, ``into=model.state_dict()``.
        From the daemon's memory when it holds a replica of that very tag, else from storage,
        and ``source`` says which. The tag comes from the commit markers on storage, so
        every rank of a job picks the same one and never mixes steps; None if none is committed.
        A tag deleted while it is read (another job's prune) gives way to the newest committed
        one. ``weights_only`` as in ``datastates.load``: safe by default.
        """
        def read(path: str) -> Any:
            return load(path, map_location, into=into, strict=strict, weights_only=weights_only)

        return self.restore_with(root, name, read, tag)

    def restore_with(self, root: str | os.PathLike, name: str, read: Callable[[str], Any],
                     tag: str | None = None) -> Restored | None:
        """``restore`` through the caller's own ``read(path)`` of the file (say, of a few slices of it): given the
        path of the daemon's replica where it holds one of that very tag, else of the file in storage.
        ``Restored.state`` is what ``read`` returned."""
        root = os.fspath(root)
        root = backend_for(root).absolute(root)
        tag = check_tag(tag) if tag is not None else None
        return again_if_deleted(lambda: self._restore(root, name, tag, read), root)

    def _restore(self, root: str, name: str, tag: str | None, read: Callable[[str], Any]) -> Restored | None:
        """One try of ``restore``: FileNotFoundError where the tag it picked was deleted meanwhile."""
        found = locate(root, self.tiers, tag, self.ranks.num_nodes > 1)
        if found is None:
            return None
        tag, folder, marker = found.tag, found.folder, found.marker
        entry = next((f for f in marker.files if f.path == name), None)
        if entry is None:
            raise InvalidRequestError(f"{name!r} is not a file of tag {tag!r} (it has: "
                                      f"{', '.join(sorted(f.path for f in marker.files)[:8])})")
        path = os.path.join(folder, name)
        why_not = "fallback='local': no daemon"
        if self._local is None:
            written = os.path.join(found.written, name)
            try:
                reply = self._daemon().call(m.Restore(path=written, tag=tag, size=entry.size, snapshot=entry.snapshot),
                                            self.timeout)
                if reply.replica:
                    state = read(reply.replica)
                    log.info("restored %s (tag %s) from the daemon's memory", written, tag)
                    return Restored(tag=tag, path=written, source="memory", state=state)
                why_not = reply.why_not
            except DatastatesError as exc:  # the replica went, or the daemon: storage still has it
                why_not = f"{exc.code}: {exc}"
        state = read(path)
        if not backend_for(path).mounted:  # no rename there: a tag saved again has its objects replaced one by one, under no marker
            now = trusted_marker(os.path.join(folder, marker_name(tag)))  # the bucket just answered: an error is one
            if now is None or now.sequence != marker.sequence or \
                    next((f.snapshot for f in now.files if f.path == name), None) != entry.snapshot:
                raise FileNotFoundError(2, "the tag was saved again while it was read", path)  # picked anew
        log.info("restored %s (tag %s) from storage%s: %s", path, tag, f" tier {found.tier}" * bool(found.tier), why_not)
        return Restored(tag=tag, path=path, source="storage", state=state, why_not_memory=why_not, tier=found.tier)

    def status(self) -> dict[str, Any]:
        return self._daemon().call(m.Status(), self.timeout).status

    def close(self, timeout: float | None = None) -> None:
        """Leave the daemon once outstanding requests (commits) are answered, or ``timeout`` passes.

        What the daemon has already taken is flushed whether or not the client stays.
        Snapshots the daemon reads from this process's own memory (GPU, and CPU read in
        place) are waited for first: that memory goes when the process does.
        """
        if self._local is not None:
            return
        if any(any(d.kind in (CUDA_IPC, VM) for d in msg.sources) for _, msg, _ in self._uncopied):
            try:
                self.wait(timeout)
            except DatastatesError as exc:
                log.warning("a snapshot was not copied before close: %s", exc)
        concurrent.futures.wait(self._conn.outstanding(), timeout)
        try:
            self._conn.call(m.Bye(), min(self.timeout, 5.0))
        except DatastatesError as exc:  # the daemon may be gone already; closing still succeeds
            log.info("datastatesd did not acknowledge BYE: %s", exc)
        finally:
            self._conn.close()
            with self._commits_lock:  # what the daemon has not copied yet it maps itself: our segments may go
                self._uncopied = []
            self._staging.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
