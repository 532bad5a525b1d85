"""The registry of connected clients and of the shared regions the daemon opened for each.

A region is opened once per client and handle. The cache keeps the regions that the
latest snapshot of each file name used (model_states.pt, optim_states.pt, ...), which are
the ones the next checkpoint will name again; a region no snapshot uses any longer is
dropped, and unmapped once no job still copies from it.

CUDA regions are kept by handle instead, and only once a handle came back: the client
shares each storage once and names the same handle in every snapshot of it. A handle seen
for the first time may be a tensor made for this one state dict (a clone, a cast, an EMA
copy) that the trainer frees right after ``wait()``: its region goes as soon as its
snapshot is copied, which gives its count back, so the trainer's allocator frees the block
at once instead of parking it until the next snapshot. A handle named again is a
long-lived storage: its region is kept until the client retires it (the trainer freed the
storage) or leaves. Each open region holds one count on the handle's slot in the trainer's
reference counter, and a handle never opened has its count given back at once
(daemon/sources/cuda.py).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from datastates.protocol import messages as m
from datastates.protocol import outcome
from datastates.protocol.descriptors import CUDA_IPC, Ranks, SourceDesc
from datastates.protocol.errors import InvalidRequestError, UnknownClientError
from datastates.protocol.liveness import process_start, shares_pids

from .config import LOST_HISTORY
from .sources import Owner, Region, open_region
from .sources.cuda import adjust_ref_counter, check_ref_counter_name, decode_handle, open_cuda, release_unopened
from .sources.vm import probe

log = logging.getLogger(__name__)

_Key = tuple[str, str]
_Slot = tuple[str, int]
"""A CUDA storage's slot in its trainer's reference-counter file: (file name, offset)."""
HEARTBEATS_PER_TIMEOUT = 6
NAMES_CACHED = 16
"""File names whose latest snapshot's shared-memory mappings a client's region cache keeps."""
MAX_GPUS = 64
"""GPUs whose probe outcome ``status`` keeps per client (a bound on what a client's probes make it store)."""
MAX_CUDA_HANDLES = 1 << 20
"""CUDA storages one client may name without retiring them (a bound on what a buggy client makes the daemon keep)."""
GONE_KEPT = 1024
"""Clients taken as gone (or that said BYE) whose pid is kept, to release the CUDA handles of a snapshot they
send after all."""


def _slot(fields: dict[str, Any]) -> _Slot:
    return fields["ref_counter"].lstrip("/"), fields["ref_counter_offset"]


def _cuda_handles(sources: list[SourceDesc]) -> Iterator[tuple[SourceDesc, dict[str, Any]]]:
    """The CUDA sources among ``sources`` whose handle names a slot, with its decoded fields."""
    for desc in sources:
        if desc.kind == CUDA_IPC:
            try:
                yield desc, decode_handle(desc.handle)
            except InvalidRequestError:
                continue


@dataclass
class ClientRecord:
    id: str
    identity: bytes
    pid: int
    name: str
    host: str
    on_busy: str = "block"
    ranks: Ranks = field(default_factory=Ranks)
    connected: float = field(default_factory=time.monotonic)
    seen: float = field(default_factory=time.monotonic)
    """When the client last sent anything; a client silent past client_timeout is taken as gone."""
    decisions: str = ""
    """The client's decision folder (protocol/outcome.py), checked at HELLO; "" if it sent none."""
    started: str | None = None
    """The client process's start time, when the daemon can watch its pid (same host and pid namespace)."""
    began_ns: int = 0
    """When the client's process started, as it says (HELLO ``began_ns``): where its job's attempt began."""
    vm_refused: str = "not probed"
    """Why the daemon cannot read this client's CPU memory in place; "" when it can (daemon/sources/vm.py)."""
    gpu_capture: dict[str, str] = field(default_factory=dict)
    """GPU UUID → "ipc", or "refused: <why>": what the client's CUDA probe of that device found."""
    _cuda: dict[_Slot, tuple[str, Region | None]] = field(default_factory=dict)
    """The CUDA storages this client named and has not retired, by their ref-counter slot: the handle, and the
    region kept for it, or None where none is kept (seen once: its region went with its snapshot's copy; or
    never opened). Every slot here had the share's count taken already: a new open adds its own first."""
    _regions: dict[_Key, Region] = field(default_factory=dict)
    _by_name: collections.OrderedDict[str, set[_Key]] = field(default_factory=collections.OrderedDict)
    """The handles of the latest snapshot of each file name, for the ``NAMES_CACHED`` names used last."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards the caches; never held while a CUDA block is opened, which can take long."""

    def regions_for(self, path: str, sources: list[SourceDesc]) -> list[Region]:
        """The mapped region of each source, opening only those not mapped yet.

        Shared-memory mappings are kept for the next snapshot of the same file name (its
        storages are the same segments), for the last ``NAMES_CACHED`` names only: a trainer
        that names each file anew (``epoch_{i}.pt``) with fresh tensors would otherwise keep
        every segment it ever freed mapped in the daemon. CUDA regions are kept until retired.
        """
        out = []
        for i, desc in enumerate(sources):
            if desc.kind == CUDA_IPC:
                try:
                    out.append(self._cuda_region(desc))
                except BaseException:
                    self.release_unopened(sources[i + 1:])
                    raise
            else:
                with self._lock:
                    out.append(self._shared_region(desc))
        with self._lock:
            name = os.path.basename(path)
            self._by_name.pop(name, None)
            self._by_name[name] = {(d.kind, d.handle) for d in sources if d.handle and d.kind != CUDA_IPC}
            while len(self._by_name) > NAMES_CACHED:
                self._by_name.popitem(last=False)
            live = set().union(*self._by_name.values())
            for key in [k for k in self._regions if k not in live]:
                del self._regions[key]
        return out

    def _shared_region(self, desc: SourceDesc) -> Region:
        key = (desc.kind, desc.handle)
        region = self._regions.get(key)
        if region is None:
            region = open_region(desc, self.owner)
            if desc.handle and not region.in_trainer:
                self._regions[key] = region
        elif region.nbytes != desc.nbytes:
            raise InvalidRequestError(f"source {desc.handle!r} was {region.nbytes} bytes and is now declared {desc.nbytes}")
        return region

    def _cuda_region(self, desc: SourceDesc) -> Region:
        """The region of a CUDA handle: kept from an earlier snapshot, or opened now; whatever happens, its slot
        stays balanced. Opened for the first time, only the snapshot holds it; opened again, it is kept.

        Admissions of one client never overlap (``Admissions.admitting``), so the open runs
        outside the lock: the event loop's ``retire`` and ``release`` never wait on it.
        """
        fields = decode_handle(desc.handle)
        slot = _slot(fields)
        with self._lock:
            known = self._cuda.get(slot)
        if known is not None:
            handle, region = known
            if handle != desc.handle:
                raise InvalidRequestError("two different CUDA handles name one reference-counter slot")
            if region is not None:
                if region.nbytes != desc.nbytes:
                    raise InvalidRequestError(f"a CUDA source was {region.nbytes} bytes and is now declared "
                                              f"{desc.nbytes}")
                return region
        elif len(self._cuda) >= MAX_CUDA_HANDLES:  # the refusal releases it (``release_unopened``)
            raise InvalidRequestError(f"a client may name at most {MAX_CUDA_HANDLES} CUDA storages it has not retired")
        if known is not None:  # the share's count was taken: this open adds its own
            check_ref_counter_name(fields["ref_counter"], self.pid)
            adjust_ref_counter(fields["ref_counter"], fields["ref_counter_offset"], +1)
        try:
            region = open_cuda(fields, desc.nbytes, self.pid)
        except BaseException:
            with self._lock:  # the open gave its count back (if the slot was this client's)
                self._cuda[slot] = (desc.handle, None)
            raise
        with self._lock:
            self._cuda[slot] = (desc.handle, region if known is not None else None)
        return region

    def release_unopened(self, sources: list[SourceDesc]) -> None:
        """A snapshot refused or skipped before these sources were opened: give back the counts of its CUDA
        handles not seen before, so the trainer frees their blocks when it frees the storages. Past
        ``MAX_CUDA_HANDLES`` a handle is released without being remembered: a release never goes below zero."""
        for desc, fields in _cuda_handles(sources):
            slot = _slot(fields)
            with self._lock:
                if slot in self._cuda:
                    continue
                if len(self._cuda) < MAX_CUDA_HANDLES:
                    self._cuda[slot] = (desc.handle, None)
            release_unopened(fields, self.pid)

    def retire(self, handles: list[str]) -> None:
        """The trainer freed these storages: drop their regions (which releases their slots)."""
        slots = []
        for handle in handles:
            try:
                slots.append(_slot(decode_handle(handle)))
            except InvalidRequestError:
                continue
        with self._lock:
            for slot in slots:
                self._cuda.pop(slot, None)

    @property
    def owner(self) -> Owner:
        return Owner(pid=self.pid, started=self.started, readable=self.vm_refused)

    def release(self) -> None:
        with self._lock:
            self._cuda.clear()
            self._regions.clear()
            self._by_name.clear()

    def gone(self, timeout: float) -> bool:
        """A client that said it left for good (protocol/outcome.py), a watched pid that exited (or was reused);
        otherwise no message, not even a heartbeat, for ``timeout`` s."""
        if self.decisions and outcome.has_left(self.decisions):
            return True
        if self.started is not None:
            return process_start(self.pid) != self.started
        return time.monotonic() - self.seen > timeout

    def probed_gpu(self, handle: str, refused: str) -> None:
        """What the CUDA probe of one of its GPUs found (``refused``: why IPC does not serve it), for ``status``."""
        try:
            uuid = decode_handle(handle)["uuid"][:64]
        except InvalidRequestError:
            uuid = "?"
        if uuid in self.gpu_capture or len(self.gpu_capture) < MAX_GPUS:
            self.gpu_capture[uuid] = f"refused: {refused}" if refused else "ipc"
        if refused:
            log.warning("client %s's GPU %s goes through host memory: %s", self.id, uuid, refused)

    def status(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "pid": self.pid,
            "host": self.host,
            "connected_s": round(time.monotonic() - self.connected, 1),
            "silent_s": round(time.monotonic() - self.seen, 1),
            "watched_by": "heartbeat" if self.started is None else "pid",
            "capture": "shm: " + self.vm_refused if self.vm_refused else "vm",
            "on_busy": self.on_busy,
            "rank": self.ranks.rank,
            "local_rank": self.ranks.local_rank,
            "world_size": self.ranks.world_size,
            "node_rank": self.ranks.node_rank,
            "job": self.ranks.job,
            "regions": len(self._regions),
            "gpu_regions": sum(r is not None for _handle, r in list(self._cuda.values())),
            "gpu_capture": dict(self.gpu_capture),
        }


OnGone = Callable[[ClientRecord, str], dict[str, Any]]
"""What the daemon does for a client taken as gone (``how``: left, exited, or silent); facts for ``status``."""


class ClientRegistry:
    def __init__(self) -> None:
        self.lost: collections.deque[dict[str, Any]] = collections.deque(maxlen=LOST_HISTORY)
        """Clients that went without BYE (a killed trainer), newest last."""
        self._by_identity: dict[bytes, ClientRecord] = {}
        self._gone_pids: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        """Identity → pid of the clients removed last (``GONE_KEPT``), for ``release_orphaned``."""
        self._ids = itertools.count(1)
        self._host = socket.gethostname()

    def add(self, identity: bytes, hello: m.Hello, ipc: bool) -> ClientRecord:
        """Register ``hello``'s client. ``ipc``: the daemon listens on a 0700 ipc socket, so every client is this
        user's, and only such a client's memory is read in place (a TCP client could name any pid of this user)."""
        if hello.on_busy not in m.ON_BUSY:
            raise InvalidRequestError(f"on_busy: {hello.on_busy[:32]!r} is not one of {list(m.ON_BUSY)}")
        old = self._by_identity.pop(identity, None)
        if old is not None:
            old.release()
        self._gone_pids.pop(identity, None)
        record = ClientRecord(
            id=f"c{next(self._ids)}-{hello.pid}", identity=identity, pid=hello.pid, name=hello.name[:128],
            host=hello.host[:128], on_busy=hello.on_busy, ranks=hello.ranks.check(),
            decisions=outcome.check_folder(hello.decisions), began_ns=max(0, hello.began_ns),
        )
        if hello.host == self._host and shares_pids(hello.pidns, hello.started, hello.pid):
            record.started = process_start(hello.pid)
            record.vm_refused = probe(hello.pid, hello.probe) if ipc else "the daemon listens on TCP"
        else:
            record.vm_refused = "the client is on another host or in another pid namespace"
        self._by_identity[identity] = record
        return record

    def known(self, identity: bytes) -> bool:
        return identity in self._by_identity

    def get(self, identity: bytes) -> ClientRecord:
        record = self._by_identity.get(identity)
        if record is None:
            raise UnknownClientError("unknown client: send HELLO first (or the daemon restarted: reconnect)")
        return record

    def touch(self, identity: bytes) -> None:
        record = self._by_identity.get(identity)
        if record is not None:
            record.seen = time.monotonic()

    def remove(self, identity: bytes) -> ClientRecord | None:
        record = self._by_identity.pop(identity, None)
        if record is not None:
            record.release()
            self._gone_pids[identity] = record.pid
            while len(self._gone_pids) > GONE_KEPT:
                self._gone_pids.popitem(last=False)
        return record

    def release_orphaned(self, identity: bytes, sources: list[SourceDesc]) -> None:
        """A snapshot from a client no longer registered (taken as gone, or it said BYE) is refused: give back the
        counts its CUDA handles hold, against the pid that client registered with, or its trainer parks those
        blocks for good. Handles the daemon saw from it before were released when it was removed, and a
        release never goes below zero. Nothing for an identity unknown (the daemon restarted since)."""
        pid = self._gone_pids.get(identity)
        if pid is not None:
            for _desc, fields in _cuda_handles(sources):
                release_unopened(fields, pid)

    async def watch(self, timeout: float, stopped: asyncio.Event, on_gone: OnGone) -> None:
        """Drop clients that exited or went silent: a trainer killed without BYE must not pin its memory here forever."""
        while not stopped.is_set():
            try:
                await asyncio.wait_for(stopped.wait(), timeout / HEARTBEATS_PER_TIMEOUT)
            except TimeoutError:
                pass
            for record in [c for c in self._by_identity.values() if c.gone(timeout)]:
                how = ("left" if record.decisions and outcome.has_left(record.decisions)  # gave this daemon up
                       else "exited" if record.started is not None else f"silent for {timeout:.0f} s")
                self.remove(record.identity)
                facts = on_gone(record, how)
                self.lost.append({"id": record.id, "name": record.name, "pid": record.pid, "how": how, **facts,
                                  "lost_ns": time.time_ns()})
                log.warning("client %s (%s, pid %d) %s without BYE: taken as gone (%s)", record.id, record.name,
                            record.pid, how, ", ".join(f"{k} {v}" for k, v in facts.items()))

    def alive(self, client_id: str, timeout: float) -> bool:
        """Whether client ``client_id`` is registered and not (yet seen) gone."""
        return any(c.id == client_id and not c.gone(timeout) for c in list(self._by_identity.values()))

    def connected(self) -> int:
        return len(self._by_identity)

    def has_rank(self, ranks: Ranks) -> bool:
        """Whether a registered client is that rank of that job (a process may hold several clients)."""
        return any((c.ranks.job, c.ranks.world_size, c.ranks.rank) == (ranks.job, ranks.world_size, ranks.rank)
                   for c in list(self._by_identity.values()))

    def of_job(self, ranks: Ranks) -> set[str]:
        """The ids of the registered clients of that job (its other ranks on this node, and that rank's other clients)."""
        return {c.id for c in list(self._by_identity.values()) if (c.ranks.job, c.ranks.world_size) == (ranks.job, ranks.world_size)}

    def release_all(self) -> None:
        """Drop every client's regions (the daemon is stopping)."""
        for record in list(self._by_identity.values()):
            record.release()

    def status(self) -> list[dict[str, Any]]:
        return [c.status() for c in self._by_identity.values()]
