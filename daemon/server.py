"""The daemon's ROUTER loop: decode, dispatch by message type, reply, and never fall over.

Each request is handled in its own task, so a WAIT or COMMIT that takes seconds does not
hold up anyone else. Every handler runs inside one error boundary: a DatastatesError
becomes an ERROR reply with its code, anything else is logged and reported as
``internal``, and the loop goes on serving.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import logging
import os
import socket
import time
from typing import Any, Awaitable, Callable

import torch
import zmq
import zmq.asyncio

from datastates.protocol import messages as m
from datastates.protocol.errors import (
    DatastatesError,
    InvalidRequestError,
    ProtocolError,
    ShuttingDownError,
    SnapshotFailedError,
)
from datastates.protocol.format import check_tag
from datastates.protocol.version import PROTOCOL_VERSION

from .clients import ClientRecord, ClientRegistry
from .commit import CommitLedger
from .config import NodeConfig
from .engine import Engine
from .job import SnapshotJob
from .memory import HostPool
from .paths import check_path
from .plan import plan_snapshot
from .restore_cache import RestoreCache

log = logging.getLogger(__name__)

HISTORY = 256
DRAIN_GRACE = 1.0
HEARTBEATS_PER_TIMEOUT = 6
Handler = Callable[[bytes, Any], Awaitable[m.Body]]


class Daemon:
    def __init__(self, cfg: NodeConfig) -> None:
        self.cfg = cfg
        self.pool = HostPool(cfg.chunk_size, cfg.chunks, pinned=cfg.pin_host_memory and torch.cuda.is_available())
        owner = hashlib.sha1(f"{socket.gethostname()} {cfg.endpoint}".encode()).hexdigest()[:10]
        self.engine = Engine(self.pool, cfg.copy_threads, cfg.flush_threads, cfg.direct_io, owner)
        self.leftovers: list[str] | None = None
        self._recovered = asyncio.Event()
        self.clients = ClientRegistry()
        self.ledger = CommitLedger(self.engine, cfg.storage, cfg.commit_timeout)
        self.restore_cache = RestoreCache(cfg.memory_restore, cfg.memory_restore_budget, owner)
        self.jobs: dict[int, SnapshotJob] = {}
        self._finished: collections.deque[int] = collections.deque()
        self._job_ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._admitting: dict[str, set[asyncio.Future]] = {}
        self._started = time.monotonic()
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
        }
        self.lost: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        """Clients that went silent without BYE (a killed trainer), newest last."""

    # -- the loop ---------------------------------------------------------------------

    async def serve(self, sock: zmq.asyncio.Socket) -> None:
        self._sock = sock
        self._spawn(self._recover())
        self._spawn(self._watch_clients())
        if self.cfg.prefault:
            self._spawn(self.engine.prefill())
        stop = asyncio.ensure_future(self.stopped.wait())
        while not self.stopped.is_set():
            recv = asyncio.ensure_future(sock.recv_multipart())
            done, _ = await asyncio.wait({recv, stop}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                break
            frames = recv.result()
            self._spawn(self._handle(frames[0], frames[1:]))
        self.ledger.tiers.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _handle(self, identity: bytes, frames: list[bytes]) -> None:
        parent = None
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
        await self._sock.send_multipart([identity, *m.encode(reply, 0, parent=parent)])

    # -- handlers ---------------------------------------------------------------------

    async def _hello(self, identity: bytes, body: m.Hello) -> m.Welcome:
        record = self.clients.add(identity, body)
        log.info("client %s connected (pid %d, %s)", record.id, body.pid, body.name)
        return m.Welcome(
            client_id=record.id, daemon_pid=os.getpid(), roots=self.cfg.storage.roots,
            heartbeat_s=self.cfg.client_timeout / HEARTBEATS_PER_TIMEOUT, tiers=self.cfg.storage.tiers,
        )

    async def _admitted(self, client_id: str) -> None:
        """Let the client's SNAPSHOTs sent before this request finish admission first.

        Clients do not wait for the admission reply, so a WAIT or COMMIT can arrive while
        the snapshot it is about is still being admitted on a thread.
        """
        pending = list(self._admitting.get(client_id, ()))
        if pending:
            await asyncio.wait(pending)

    async def _snapshot(self, identity: bytes, body: m.Snapshot) -> m.SnapshotAck:
        client = self.clients.get(identity)
        before = list(self._admitting.get(client.id, ()))
        admitting = asyncio.get_running_loop().create_future()  # registered before any await: see _admitted
        self._admitting.setdefault(client.id, set()).add(admitting)
        try:
            if before:  # one client's snapshots are admitted in order: same-path renames and on_busy rely on it
                await asyncio.wait(before)
            return await self._admit(client, body)
        finally:
            admitting.set_result(None)
            self._admitting[client.id].discard(admitting)
            if not self._admitting[client.id]:
                del self._admitting[client.id]

    async def _admit(self, client: ClientRecord, body: m.Snapshot) -> m.SnapshotAck:
        await self._recovered.wait()  # its temp names share our owner prefix with the leftovers
        if self.draining and time.monotonic() >= self._refuse_after:
            raise ShuttingDownError("datastatesd is shutting down and takes no new snapshots")
        check_tag(body.tag)
        if client.on_busy == "skip":
            reason = self.ledger.skipped(client.id, body.tag) or self._busy(client.id, body.tag)
            if reason:
                self.ledger.skip(client.id, body.tag, reason)
                log.warning("skipped a snapshot of %s for %s (on_busy: skip): %s", body.tag, client.id, reason)
                return m.SnapshotAck(snapshot_id=0, total_bytes=0, skipped=reason)

        def admit() -> tuple[Any, Any]:
            path = check_path(body.path, self.cfg.storage.roots)
            plan = plan_snapshot(body, path, self.cfg.chunk_size)
            return plan, client.regions_for(path, body.sources)

        plan, regions = await asyncio.get_running_loop().run_in_executor(None, admit)
        earlier = [j for j in self.jobs.values() if j.path == plan.path and j.pending]
        job = SnapshotJob(next(self._job_ids), client.id, body.tag, plan, regions)
        job.keep = self.restore_cache.reserve(job, client.ranks)
        self.jobs[job.id] = job
        self.ledger.add(job)
        self._spawn(self._run(job, earlier))
        return m.SnapshotAck(snapshot_id=job.id, total_bytes=job.total_bytes)

    def _busy(self, client_id: str, tag: str) -> str:
        """Why a new tag's snapshot would queue behind an older tag's, or '' if it would not."""
        older = next((j for j in self.jobs.values() if j.client_id == client_id and j.tag != tag and j.pending), None)
        return "" if older is None else f"tag {older.tag!r} is still {older.state.value} {older.path}"

    async def _recover(self) -> None:
        """Remove this daemon's half-written files from a killed earlier run, before admitting any."""
        try:
            self.leftovers = await self.engine.remove_leftovers(self.cfg.storage.roots)
        finally:
            self._recovered.set()
        if self.leftovers:
            log.warning("removed %d partial file(s) left by an earlier run: %s", len(self.leftovers), self.leftovers[:5])
        resumed = await self.ledger.tiers.resume()
        if resumed:
            log.warning("resuming %d tier cop(ies) an earlier run left undone: %s", len(resumed), resumed[:5])

    async def _run(self, job: SnapshotJob, earlier: list[SnapshotJob]) -> None:
        await self.engine.run(job, after=[j.durable for j in earlier])
        if job.keep is None or job.error is not None:  # its in-memory copy failed, or the snapshot did
            self.restore_cache.discard(job.id)
        self._finished.append(job.id)
        while len(self._finished) > HISTORY:
            self.jobs.pop(self._finished.popleft(), None)

    async def _wait(self, identity: bytes, body: m.Wait) -> m.WaitDone:
        client = self.clients.get(identity)
        await self._admitted(client.id)
        ids = body.snapshot_ids or [j.id for j in self.jobs.values() if j.client_id == client.id]
        jobs = []
        for i in ids:
            job = self.jobs.get(i)
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
        await self._admitted(client.id)
        mine = [j for j in self.jobs.values() if j.client_id == client.id and j.tag == body.tag]
        committed = await self.ledger.commit(client.id, check_tag(body.tag), client.ranks)
        self.restore_cache.committed(body.tag, mine)
        log.info("tag %s committed by %s: %s", body.tag, client.id, committed.marker)
        return committed

    async def _restore(self, identity: bytes, body: m.Restore) -> m.RestoreReply:
        self.clients.get(identity)
        kept, why_not = self.restore_cache.lookup(check_path(body.path, self.cfg.storage.roots), body.tag, body.size)
        return m.RestoreReply(copy=kept.copy if kept else "", why_not=why_not)

    async def _status(self, identity: bytes, body: m.Status) -> m.StatusReply:
        return m.StatusReply(status=self.status())

    async def _shutdown(self, identity: bytes, body: m.Shutdown) -> m.ShutdownAck:
        await self.drain()
        return m.ShutdownAck()

    async def _bye(self, identity: bytes, body: m.Bye) -> m.ByeAck:
        self._drop(identity)
        return m.ByeAck()

    async def _heartbeat(self, identity: bytes, body: m.Heartbeat) -> m.HeartbeatAck:
        return m.HeartbeatAck()

    def _drop(self, identity: bytes) -> ClientRecord | None:
        """Forget a client: its open tags, and its region cache (jobs in flight keep their own maps)."""
        record = self.clients.remove(identity)
        if record is not None:
            self.ledger.forget(record.id)
        return record

    async def _watch_clients(self) -> None:
        """Drop clients that exited or went silent: a trainer killed without BYE must not pin its memory here forever."""
        timeout = self.cfg.client_timeout
        while not self.stopped.is_set():
            try:
                await asyncio.wait_for(self.stopped.wait(), timeout / HEARTBEATS_PER_TIMEOUT)
            except TimeoutError:
                pass
            for record in self.clients.gone(timeout):
                self._drop(record.identity)
                if record.ranks.world_size > 1:
                    self.ledger.rank_lost(record.ranks)
                how = "exited" if record.started is not None else f"silent for {timeout:.0f} s"
                mine = [j for j in self.jobs.values() if j.client_id == record.id]
                abandoned = sum(j.abandon_device_copy(f"its trainer {how}") for j in mine)
                pending = sum(1 for j in mine if j.pending) - abandoned
                self.lost.append({"id": record.id, "name": record.name, "pid": record.pid, "how": how,
                                  "pending_snapshots": pending, "abandoned_gpu_snapshots": abandoned,
                                  "lost_ns": time.time_ns()})
                log.warning("client %s (%s, pid %d) %s without BYE: taken as gone; %d pending snapshot(s) still "
                            "finish, %d GPU snapshot(s) not yet copied fail", record.id, record.name, record.pid, how,
                            pending, abandoned)

    # -- lifecycle and status ---------------------------------------------------------

    def pending_jobs(self) -> list[SnapshotJob]:
        return [j for j in self.jobs.values() if j.pending]

    def request_shutdown(self) -> None:
        """What SIGTERM does: the same drain as a SHUTDOWN message."""
        self._spawn(self.drain())

    async def drain(self) -> None:
        """Stop taking snapshots, let every pending one, every commit and every tier copy finish, then stop.

        For DRAIN_GRACE seconds snapshots are still admitted: ``snapshot()`` returns once its
        message is sent, so one sent just before the signal may not have been read yet.
        """
        if not self.draining:
            self.draining = True
            self._refuse_after = time.monotonic() + DRAIN_GRACE
            log.info("draining: %d snapshot(s) pending", len(self.pending_jobs()))
            await asyncio.sleep(DRAIN_GRACE)
        while True:
            pending = [j.durable for j in self.pending_jobs()]
            if pending:
                await asyncio.wait(pending, timeout=0.5)
            elif self.ledger.pending or self.ledger.tiers.pending() or any(self._admitting.values()):
                await asyncio.sleep(0.05)
            else:
                break
        asyncio.get_running_loop().call_later(0.2, self.stopped.set)

    def status(self) -> dict[str, Any]:
        jobs = [j.status() for j in self.jobs.values()]
        return {
            "daemon": {
                "pid": os.getpid(),
                "endpoint": self.cfg.endpoint,
                "protocol_version": PROTOCOL_VERSION,
                "uptime_s": round(time.monotonic() - self._started, 1),
                "draining": self.draining,
                "roots": self.cfg.storage.roots,
                "host_memory": self.pool.status(),
                "leftovers_removed": None if self.leftovers is None else {
                    "count": len(self.leftovers), "paths": self.leftovers[:20]},
            },
            "clients": self.clients.status(),
            "clients_lost": list(self.lost),
            "snapshots": jobs,
            "pending": sum(1 for j in self.jobs.values() if j.pending),
            "commits_pending": self.ledger.pending,
            "tags_gathering": self.ledger.groups(),
            "tier_copies": self.ledger.tiers.status(),
            "restore_cache": self.restore_cache.status(),
            "committed": list(self.ledger.committed),
        }
