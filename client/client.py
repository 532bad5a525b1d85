"""The thin client a training rank holds: capture, one message, and futures."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import shutil
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from datastates.protocol import messages as m
from datastates.protocol import outcome
from datastates.protocol.descriptors import Ranks, Tier
from datastates.protocol.endpoint import resolve_endpoint
from datastates.protocol.errors import DaemonUnavailable, DatastatesError, InvalidRequestError
from datastates.protocol.format import check_tag
from datastates.protocol.storage import backend_for
from datastates.protocol.liveness import pid_namespace, process_began_ns, process_start
from datastates.protocol.paths import check_derived, check_path

from .capture import capture, gc_paused
from .cuda import GpuRoute
from .connection import DEFAULT_LIVENESS, Connection, daemon_status  # noqa: F401  (daemon_status: re-exported)
from .inflight import Expected, InFlight, SentSnapshot
from .shm import SegmentPool
from .vm_access import Probe, allow_reader, yama_scope
from .locate import again_if_deleted, locate
from .reader.restore import MapLocation, load
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


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


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
        self._segments = SegmentPool()
        self._gpu = GpuRoute(gpu_capture, self._segments, self._probe_cuda)
        self._inflight = InFlight(self.endpoint, fallback)
        self._reconnecting = threading.RLock()
        """Held while one thread finds the connection lost and makes a new one: a reader's threads restoring files
        at once (integrations/dcp.py) make one, not one each."""
        self._tickets = itertools.count(1)
        self._name = name or f"pid{os.getpid()}"
        self._on_busy = on_busy
        self._liveness = liveness
        try:
            self._connect()
        except DaemonUnavailable as exc:
            self._inflight.go_local(self._conn, exc)

    def _connect(self) -> None:
        """Say HELLO on a new connection, with a new decision folder: to the daemon, a new client.

        At construction, and again after a lost daemon (``_reconnect``): a daemon that was
        stalled past liveness, or restarted, does not know the old connection's client.
        """
        self._conn = Connection(self.endpoint, self._liveness)
        decisions = outcome.make_folder()
        self._inflight.connecting(decisions)
        hello = m.Hello(pid=os.getpid(), name=self._name, host=socket.gethostname(), on_busy=self._on_busy,
                        pidns=pid_namespace(), started=process_start(os.getpid()) or "", ranks=self.ranks,
                        began_ns=process_began_ns(os.getpid()),
                        decisions=decisions, probe=str(self._probe or ""))
        try:
            if self._probe is not None and yama_scope() == 1:  # the daemon is no ancestor: name it our reader first
                allow_reader(self._conn.call(m.Status(), self.timeout).status["daemon"]["pid"])
            welcome = self._conn.call(hello, self.timeout)
        except BaseException:
            # a daemon that welcomed it all the same (its WELCOME too late) takes the folder gone as this client gone
            shutil.rmtree(decisions, ignore_errors=True)
            self._conn.close()
            raise
        self._inflight.left = False
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
        return self._inflight.saver is not None

    def snapshot(self, state: Any, path: str | os.PathLike, tag: str | None = None) -> SnapshotHandle:
        """Hand ``state`` to the daemon, to be written to ``path``; returns once the message is sent.

        The trainer pays for the tree walk and one message, never for a copy: the daemon
        admits and copies in the background, so tensors must not change in place until
        ``wait()`` returns. A path outside the daemon's roots is refused here; any other
        refusal is raised by the next ``wait()``. ``tag`` defaults to the parent folder's name.
        """
        path = os.path.abspath(os.fspath(path))
        tag = check_tag(tag if tag is not None else os.path.basename(os.path.dirname(path)))
        saver = self._inflight.local_saver(self._conn)
        if saver is not None:  # this process saves it: it reads every storage itself
            cap = capture(state)
            msg = m.Snapshot(path=path, tag=tag, sources=cap.sources, entries=cap.entries, root=cap.root)
            return SnapshotHandle(path=path, tag=tag, ack=_done(saver.save(msg, cap.storages)))
        conn = self._daemon()  # before the capture: a new connection shares this process's GPU memory anew
        # the daemon checks both again; this makes the error immediate
        check_derived(check_path(path, self.roots), tag, self.ranks.node_rank, self.tiers)
        with gc_paused():
            cap = capture(state, None if self.in_place else self._segments, self._gpu)
            retired = self._gpu.blocks.take_retired()
            msg = m.Snapshot(path=path, tag=tag, sources=cap.sources, entries=cap.entries, root=cap.root,
                             ticket=str(next(self._tickets)), fences=cap.fences, retired=retired)
            try:
                ack = conn.request(msg)
            except BaseException:
                self._gpu.blocks.untake(retired)
                raise
        self._inflight.sent(SentSnapshot(ack, msg, cap))
        return SnapshotHandle(path=path, tag=tag, ack=ack)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the daemon holds its own copy of every snapshot taken so far.

        Raises the first failure among them (the daemon refused one, or could not copy
        it); each failure is reported by one ``wait()`` only.
        """
        self._inflight.wait(self._conn, timeout, timeout if timeout is not None else self.timeout)

    def _daemon(self) -> Connection:
        """The connection to the daemon: after one was lost (and no fallback), a new one, as a new client."""
        with self._reconnecting:
            if self.fallback is None and (self._inflight.left or self._conn.lost):
                self._reconnect()
            return self._conn

    def _reconnect(self) -> None:
        """Connect again to a daemon this client lost (stalled past liveness, restarted), as a new client, once
        what the lost connection had not committed is said lost (``InFlight.found_gone``). A daemon still away
        raises DaemonUnavailable here, and the next call tries again."""
        self._inflight.found_gone(self._conn)
        lost = self.client_id
        self._gpu = GpuRoute(self._gpu.mode, self._segments, self._probe_cuda)  # the new client shares GPU memory anew
        self._connect()
        log.info("connected to datastatesd at %s again, as client %s (was %s): what the lost connection had not "
                 "committed is lost", self.endpoint, self.client_id, lost)

    def expect(self) -> Expected:
        """Say that another thread is about to snapshot tensors this one may change next (DCP's ``async_save``
        returns before its own thread plans the save and sends the snapshot): ``wait()``, and so the fence, first
        waits until that thread has sent it (``Expected.sending``), at most ``timeout`` (or this client's
        ``timeout``) seconds; then it raises WaitTimeout once, and the snapshot may no longer be sent."""
        return self._inflight.expect()

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
        if self._inflight.saver is not None:
            return _done(self._inflight.saver.commit(tag))
        return self._inflight.commit(self._daemon(), tag)

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
        if self._inflight.saver is None:
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
        if not backend_for(path).unchanged(folder, name, marker):
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
        if self._inflight.saver is not None:
            return
        if self._inflight.in_trainer():
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
            self._inflight.clear()
            self._segments.clear()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
