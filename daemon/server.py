"""The daemon's ROUTER loop: decode, dispatch by message type, reply, and never fall over.

Each request is handled in its own task, so a WAIT or COMMIT that takes seconds does not
hold up anyone else. Every handler runs inside one error boundary: a DatastatesError
becomes an ERROR reply with its code, anything else is logged and reported as
``internal``, and the loop goes on serving. Handlers are thin: the snapshot table is
``admissions.py``, client liveness ``clients.py``, commits ``commit.py``, the tier transfers
``tiers.py`` (a listener of the ledger) and the replicas ``replica/``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Awaitable, Callable

import torch
import zmq
import zmq.asyncio

from datastates.protocol import messages as m
from datastates.protocol import outcome
from datastates.protocol.storage import backend_for
from datastates.protocol.errors import (
    DatastatesError,
    InvalidRequestError,
    ProtocolError,
    ShuttingDownError,
    SnapshotFailedError,
    TooManyClientsError,
    UnknownClientError,
)
from datastates.protocol.format import check_tag
from datastates.protocol.layout import plan_snapshot
from datastates.protocol.paths import check_derived, check_path

from .clients import HEARTBEATS_PER_TIMEOUT, ClientRecord, ClientRegistry
from .connections import Connections
from .commit import CommitLedger, tag_folder
from .config import NodeConfig
from .departures import Departures
from .engine import Engine
from .snapshot import AdmittedSnapshot
from .admissions import Admissions
from .memory import HostPool
from .instances import Instance
from .recovery import clean_up_after_kill
from .replica.table import ReplicaStore
from .tiers import TierTransfers
from .resave import Versions
from .gpus import gpus
from .sources.cuda import Fences, check_fences, flush_releases
from .sources.cuda import probe as cuda_probe
from .status import node_status

log = logging.getLogger(__name__)

DRAIN_GRACE = 1.0
Handler = Callable[[bytes, Any], Awaitable[m.Body]]


class Daemon:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.pool = HostPool(cfg.chunk_size, cfg.chunks, pinned=cfg.pin_host_memory and torch.cuda.is_available())
        self.instance = Instance(self.cfg.storage.written)
        for tier in cfg.storage.tiers:
            backend_for(tier.path).connect(tier.path, tier.endpoint, tier.region)
        owner = self.instance.owner
        self.engine = Engine(self.pool, cfg.copy_threads, cfg.flush_threads, cfg.direct_io, owner)
        self.leftovers: list[str] | None = None
        self._recovered = asyncio.Event()
        self.clients = ClientRegistry()
        self.snapshots = Admissions()
        self.versions = Versions(self.instance.owner)
        self.ledger = CommitLedger(self.engine, cfg.storage, cfg.commit_timeout, self.versions, owner)
        self.transfers = TierTransfers(self.engine, cfg.storage, self.ledger, owner, cfg.commit_timeout)
        self.replicas = ReplicaStore(cfg.memory_restore, cfg.memory_restore_budget, owner,
                                     on_removed=self.engine.replica_storage.release_removed,
                                     ready_ahead=lambda path, size, done: self._spawn(self._ready_ahead(path, size, done)),
                                     alive=lambda client: self.clients.alive(client, cfg.client_timeout))
        self.ledger.subscribe(self.replicas)
        self._tasks: set[asyncio.Task] = set()
        self.departures = Departures(self.ledger, self.clients, self.snapshots)
        self.started = time.monotonic()
        self.draining = False
        self._refuse_after = float("inf")
        self.stopped = asyncio.Event()
        self._handlers: dict[type, Handler] = {
            m.Hello: self._hello,
            m.Snapshot: self._snapshot,
            m.Wait: self._wait,
            m.Commit: self._commit,
            m.Status: self._status,
            m.Shutdown: self._shutdown,
            m.Bye: self._bye,
            m.Heartbeat: self._heartbeat,
            m.Restore: self._restore,
            m.CudaProbe: self._cuda_probe,
        }

    # -- the loop ---------------------------------------------------------------------

    async def serve(self, sock: zmq.asyncio.Socket) -> None:
        self._sock = sock
        self.connections = Connections(sock)
        self._spawn(self._recover())
        self._spawn(asyncio.get_running_loop().run_in_executor(None, gpus.hold))  # before the trainers fill the GPUs
        self._spawn(self.clients.watch(self.cfg.client_timeout, self.stopped, self.departures.gone))
        self._spawn(self.connections.watch(self.stopped))
        self._spawn(self.instance.signs_of_life(self.stopped, self.engine.flush))
        if self.cfg.prefault:
            self._spawn(self.engine.prefill())
        stop = asyncio.ensure_future(self.stopped.wait())
        while not self.stopped.is_set():
            recv = asyncio.ensure_future(sock.recv_multipart(copy=False))
            done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                break
            frames = recv.result()
            fd = frames[0].get(zmq.SRCFD)
            self._spawn(self._handle(frames[0].bytes, [f.bytes for f in frames[1:]], fd, self.connections.heard(fd)))
        self.transfers.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        # the trainers outlive this daemon: release every CUDA block it holds, or they stay parked in them
        self.clients.release_all()
        await asyncio.get_running_loop().run_in_executor(None, flush_releases, 30)

    async def _ready_ahead(self, path: str, size: int, done: Callable[[BaseException | None], None]) -> None:
        """A spare's pages readied on a flush thread (``ready_pages``), then ``done`` here with what it raised."""
        try:
            await self.engine.write(self.engine.replica_storage.ready_pages, path, size)
        except Exception as exc:
            done(exc)
        else:
            done(None)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _handle(self, identity: bytes, frames: list[bytes], fd: int, inode: int | None) -> None:
        """Answer one request that came on connection ``fd`` (its socket ``inode``: ``Connections.heard``)."""
        parent = None
        reply: m.Body | None = None
        self.clients.touch(identity)
        try:
            header = m.decode_header(frames)
            parent = header.id
            m.check_version(header)
            body = m.decode_body(header, frames[1])
            handler = self._handlers.get(type(body))
            if handler is None:
                raise ProtocolError(f"{header.type} is a reply, not a request")
            reply: m.Body = await handler(identity, body)
        except asyncio.CancelledError:
            raise
        except DatastatesError as exc:
            reply = m.Error.of(exc)
        except Exception as exc:  # the boundary: log it, report it, keep serving
            log.exception("internal error handling a request")
            reply = m.Error(code="internal", message=f"internal daemon error: {type(exc).__name__}: {exc}")
        finally:  # a connection stays only once a registered client speaks on it (daemon/connections.py)
            self.connections.answered(fd, inode, self.clients.known(identity),
                                      served=reply is not None and not isinstance(reply, m.Error))
        await self._sock.send_multipart([identity, *m.encode(reply, 0, parent=parent)])

    # -- handlers ---------------------------------------------------------------------

    async def _hello(self, identity: bytes, body: m.Hello) -> m.Welcome:
        if self.clients.connected() >= self.cfg.max_clients and not self.clients.known(identity):
            raise TooManyClientsError(f"datastatesd already serves {self.clients.connected()} clients (max_clients: "
                                      f"{self.cfg.max_clients}); raise max_clients in node.yaml, or close idle clients")
        record = self.clients.add(identity, body, ipc=self.cfg.endpoint.startswith("ipc://"))
        log.info("client %s connected (pid %d, %s; capture %s)", record.id, body.pid, body.name,
                 f"shm: {record.vm_refused}" if record.vm_refused else "vm")
        return m.Welcome(
            client_id=record.id, daemon_pid=os.getpid(), roots=self.cfg.storage.roots,
            heartbeat_s=self.cfg.client_timeout / HEARTBEATS_PER_TIMEOUT, tiers=self.cfg.storage.tiers,
            vm_refused=record.vm_refused,
        )

    async def _snapshot(self, identity: bytes, body: m.Snapshot) -> m.SnapshotAck:
        try:
            client = self.clients.get(identity)
        except UnknownClientError:  # taken as gone meanwhile: its new CUDA handles must not stay held
            self.clients.release_orphaned(identity, body.sources)
            raise
        if body.retired:
            client.retire(body.retired)
        async with self.snapshots.admitting(client.id):
            try:
                ack = await self._admit(client, body)
            except Exception as exc:  # any refusal, an internal one too: committing the tag's other files would
                # make a partial tag (the fault schedules, seed 92834)
                why = exc.message if isinstance(exc, DatastatesError) else f"internal: {type(exc).__name__}: {exc}"
                self.ledger.refuse(client.id, body.tag, f"its snapshot of {body.path} was refused: {why}", client.ranks)
                client.release_unopened(body.sources)
                raise
            if ack.skipped:
                client.release_unopened(body.sources)
            return ack

    async def _admit(self, client: ClientRecord, body: m.Snapshot) -> m.SnapshotAck:
        await self._recovered.wait()  # a snapshot's file appears only once the leftovers of its path are gone
        if self.draining and time.monotonic() >= self._refuse_after:
            raise ShuttingDownError("datastatesd is shutting down and takes no new snapshots")
        check_tag(body.tag)
        if client.on_busy == "skip":
            reason = self.ledger.skipped(client.id, body.tag) or self.snapshots.busy(client.id, body.tag)
            if reason:
                self.ledger.skip(client.id, body.tag, reason)
                log.warning("skipped a snapshot of %s for %s (on_busy: skip): %s", body.tag, client.id, reason)
                return m.SnapshotAck(snapshot_id=0, total_bytes=0, skipped=reason)

        job_id = self.snapshots.next_id()

        def admit() -> tuple[Any, str, str, Any, Any]:
            roots = self.cfg.storage.roots
            path = check_path(body.path, roots)
            check_derived(path, body.tag, client.ranks.node_rank, self.cfg.storage.tiers)
            folder = tag_folder(body.tag, {path: 0}, roots)
            written = self.versions.place(path, body.tag, folder, versioned=client.ranks.num_nodes == 1,
                                          committing=self.ledger.committing(client.id, body.tag, folder), roots=roots)
            self.ledger.check_owner(written, client.id, body.tag,
                                    lambda other: self.clients.alive(other, self.cfg.client_timeout))
            plan = plan_snapshot(body, written, self.cfg.chunk_size, f"{self.instance.owner}/{client.id}/{job_id}")
            fences = Fences(check_fences(body.fences), self.cfg.fence_timeout)
            return plan, path, folder, client.regions_for(path, body.sources), fences

        plan, path, folder, regions, fences = await asyncio.get_running_loop().run_in_executor(None, admit)
        # again, now with no await before the registration below: another client's snapshot of the same file may
        # have been admitted on another thread meanwhile, and one of the two would be lost
        self.ledger.check_owner(plan.path, client.id, body.tag,
                                lambda other: self.clients.alive(other, self.cfg.client_timeout))
        self.ledger.check_tag_owner(body.tag, folder, client.id, client.ranks,
                                    lambda other: self.clients.alive(other, self.cfg.client_timeout))
        earlier = self.snapshots.pending_at(plan.path)
        decision = (client.decisions, outcome.check_ticket(body.ticket)) if client.decisions and body.ticket else None
        job = AdmittedSnapshot(job_id, client.id, body.tag, plan, regions, decision, fences=fences, folder=folder,
                          owner_alive=lambda: self.clients.alive(client.id, self.cfg.client_timeout))
        job.replica = self.replicas.reserve(job.id, path, job.tag, job.file_size, client.ranks, job.snapshot, client.id)
        self.snapshots.add(job)
        self.ledger.add(job, client.ranks)
        self._spawn(self._run(job, earlier))
        return m.SnapshotAck(snapshot_id=job.id, total_bytes=job.total_bytes)

    async def _recover(self) -> None:
        """Remove what killed daemons of this node left (any endpoint): half-written files, replicas; then admit."""
        try:
            self.leftovers = await clean_up_after_kill(self.engine, self.cfg.storage, self.instance)
        finally:
            self._recovered.set()
        if self.leftovers:
            log.warning("removed %d leftover(s) of killed daemons: %s", len(self.leftovers), self.leftovers[:5])
        resumed = await self.transfers.resume()
        if resumed:
            log.warning("resuming %d tier transfer(s) an earlier run left undone: %s", len(resumed), resumed[:5])

    async def _run(self, job: AdmittedSnapshot, earlier: list[AdmittedSnapshot]) -> None:
        await self.engine.run(job, after=[j.durable for j in earlier])
        if job.replica is None or job.error is not None:  # its replica failed, or the snapshot did
            self.replicas.discard(job.id)
        self.snapshots.finished(job)
        self.departures.tidy(job.client_id)

    async def _cuda_probe(self, identity: bytes, body: m.CudaProbe) -> m.CudaProbeReply:
        """Open the client's probe handle and read it back, off the event loop: which path its GPU takes."""
        client = self.clients.get(identity)
        refused = await asyncio.get_running_loop().run_in_executor(None, cuda_probe, body.handle, body.expect,
                                                                   client.pid)
        client.probed_gpu(body.handle, refused)
        return m.CudaProbeReply(refused=refused)

    async def _wait(self, identity: bytes, body: m.Wait) -> m.WaitDone:
        client = self.clients.get(identity)
        await self.snapshots.admitted(client.id)
        ids = body.snapshot_ids or [j.id for j in self.snapshots.of_client(client.id)]
        jobs = []
        for i in ids:
            job = self.snapshots.get(i)
            if job is not None and job.client_id != client.id:
                raise InvalidRequestError(f"snapshot {i} belongs to another client")
            if job is not None:
                jobs.append(job)
        results = await asyncio.gather(*(j.copied for j in jobs), return_exceptions=True)
        for job, res in zip(jobs, results):
            if isinstance(res, BaseException):
                raise SnapshotFailedError(f"snapshot {job.id} of {job.path} failed: {res}", path=job.path)
        return m.WaitDone(snapshot_ids=ids)

    async def _commit(self, identity: bytes, body: m.Commit) -> m.Committed:
        client = self.clients.get(identity)
        await self.snapshots.admitted(client.id)
        if body.lost:  # part of the tag went with a daemon the client lost: the rest alone would be a partial tag
            self.ledger.refuse(client.id, check_tag(body.tag), body.lost, client.ranks)
        committed = await self.ledger.commit(client.id, check_tag(body.tag), client.ranks, client.began_ns)
        log.info("tag %s committed by %s: %s", body.tag, client.id, committed.marker)
        return committed

    async def _restore(self, identity: bytes, body: m.Restore) -> m.RestoreReply:
        client = self.clients.get(identity)
        replica, why_not = self.replicas.lookup(check_path(body.path, self.cfg.storage.roots), body.tag, body.size,
                                                body.snapshot, client.id)
        return m.RestoreReply(replica=replica.file if replica else "", why_not=why_not)

    async def _status(self, identity: bytes, body: m.Status) -> m.StatusReply:
        return m.StatusReply(status=node_status(self))

    async def _shutdown(self, identity: bytes, body: m.Shutdown) -> m.ShutdownAck:
        await self.drain()
        return m.ShutdownAck()

    async def _bye(self, identity: bytes, body: m.Bye) -> m.ByeAck:
        record = self.clients.remove(identity)  # its region cache goes; jobs in flight keep their own maps
        if record is not None:
            self.departures.depart(record, said_bye=True)
        return m.ByeAck()

    async def _heartbeat(self, identity: bytes, body: m.Heartbeat) -> m.HeartbeatAck:
        self.clients.get(identity)  # a client from before a restart must hear it is unknown, not that all is well
        return m.HeartbeatAck()

    # -- lifecycle and status ---------------------------------------------------------

    def request_shutdown(self) -> None:
        """What SIGTERM does: the same drain as a SHUTDOWN message."""
        self._spawn(self.drain())

    async def drain(self) -> None:
        """Stop taking snapshots, let every pending one, every commit and every tier transfer finish, then stop.

        For DRAIN_GRACE seconds snapshots are still admitted: ``snapshot()`` returns once its
        message is sent, so one sent just before the signal may not have been read yet.
        """
        if not self.draining:
            self.draining = True
            self._refuse_after = time.monotonic() + DRAIN_GRACE
            log.info("draining: %d snapshot(s) pending", len(self.snapshots.pending()))
            if self.clients.connected():  # with no client, no snapshot can be on its way
                await asyncio.sleep(DRAIN_GRACE)
        while True:
            pending = [j.durable for j in self.snapshots.pending()]
            if pending:
                await asyncio.wait(pending, timeout=0.5)
            elif self.ledger.pending or self.snapshots.any_admitting() or not self.transfers.drained():
                await asyncio.sleep(0.05)
            else:
                break
        asyncio.get_running_loop().call_later(0.2, self.stopped.set)
