"""The client's one ZeroMQ DEALER socket, owned by one I/O thread.

ZeroMQ sockets are not thread-safe, so training threads never touch the DEALER: they hand
frames to the I/O thread over an inproc pair and get a ``concurrent.futures.Future`` back,
resolved when the reply whose ``parent`` is their request id arrives.

ZeroMQ does not say when the peer dies, so both sides watch for silence. While requests
are outstanding the I/O thread probes the daemon with HEARTBEAT whenever it has heard
nothing for ``liveness / 2`` seconds; after ``liveness`` seconds of silence every
outstanding request fails with DaemonUnavailable, so a dead daemon never hangs the
training process. The other way, once ``heartbeat`` is set (from WELCOME), the thread
sends a HEARTBEAT whenever it has sent nothing for that long, so the daemon can tell a
trainer that vanished without BYE and release what it held for it.

Silence only means something once a daemon was there. ZeroMQ connects in the background
and retries for ever, so until the first reply each request first asks the kernel with a
plain ``connect()``: where the socket file is missing, or nobody listens (ECONNREFUSED),
no daemon runs on that endpoint, and the request fails at once with DaemonNotRunning
instead of waiting out ``liveness`` or the caller's timeout.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Callable

import zmq

from datastates.protocol import messages as m
from datastates.protocol.endpoint import ENDPOINT_ENV, resolve_endpoint
from datastates.protocol.errors import (
    DaemonNotRunning,
    DaemonUnavailable,
    DatastatesError,
    UnknownClientError,
    error_from_code,
)
from datastates.protocol.security import secure_client

log = logging.getLogger(__name__)

_STOP = b"stop"
DEFAULT_LIVENESS = 15.0
PROBE_TIMEOUT_S = 1.0
"""How long the tcp probe waits for the daemon's host; past it, the probe says nothing and ZeroMQ and the timeouts decide."""


class Connection:
    def __init__(self, endpoint: str, liveness: float = DEFAULT_LIVENESS) -> None:
        self.endpoint = endpoint
        self.liveness = liveness
        self.heartbeat = 0.0
        self.lost = False
        """Set once the daemon stayed silent past ``liveness``: a daemon that comes back does not know this client."""
        self.answered = False
        """Set once any reply arrived: from then on silence is the daemon's (``liveness``), no probe asks the kernel."""
        self.registered = False
        """Set once the daemon welcomed this client: from then on, a probe answered ``unknown_client`` means the
        daemon that holds this client's requests is gone (restarted on the same endpoint, or took it as gone)."""
        self._heard = self._sent = time.monotonic()
        self._probe: int | None = None
        self._ctx = zmq.Context()
        self._ids = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._lock = threading.RLock()  # _send may fail requests while _check_liveness holds it
        inproc = f"inproc://datastates-client-{uuid.uuid4().hex}"
        self._inbox = self._ctx.socket(zmq.PAIR)
        self._inbox.bind(inproc)
        self._outbox = self._ctx.socket(zmq.PAIR)
        self._outbox.connect(inproc)
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 2000)
        self._dealer.setsockopt(zmq.SNDHWM, 0)  # queue without bound: a send that would block means no peer at all
        try:
            secure_client(self._dealer, endpoint)
        except BaseException:
            for sock in (self._dealer, self._inbox, self._outbox):
                sock.close(0)
            self._ctx.term()
            raise
        self._dealer.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name="datastates-client-io", daemon=True)
        self._closed = False
        self._thread.start()

    def request(self, body: m.Body) -> Future:
        """Send ``body``; the future resolves to the reply body or raises the reported error."""
        if not self.answered:
            check_listening(self.endpoint)
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise DaemonUnavailable(f"connection to {self.endpoint} is closed")
            msg_id = next(self._ids)
            self._pending[msg_id] = fut
            self._outbox.send_multipart(m.encode(body, msg_id))
        return fut

    def call(self, body: m.Body, timeout: float | None) -> Any:
        fut = self.request(body)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise DaemonUnavailable(
                f"no reply from datastatesd at {self.endpoint} to {body.TYPE.value} within {timeout} s: something "
                "listens there but does not answer (a stopped or overloaded daemon; over tcp, one that refuses this "
                "client's CURVE key)" if not self.answered else
                f"no reply from datastatesd at {self.endpoint} to {body.TYPE.value} within {timeout} s",
                endpoint=self.endpoint,
            ) from None

    def outstanding(self) -> list[Future]:
        """Requests still waiting for their reply."""
        with self._lock:
            return list(self._pending.values())

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        while True:
            tick = min(self.liveness / 4, self.heartbeat / 2 or self.liveness)
            for sock, _ in poller.poll(timeout=max(50, int(tick * 1000))):
                if sock is self._inbox:
                    frames = self._inbox.recv_multipart(copy=False)
                    if len(frames) == 1 and frames[0].bytes == _STOP:
                        self._dealer.close(linger=0 if self.lost else None)  # nobody to deliver a BYE to
                        self._inbox.close()
                        return
                    self._send(frames)
                else:
                    self._heard = time.monotonic()
                    self.answered = True
                    self._deliver(self._dealer.recv_multipart())
            self._check_liveness()
            if self.heartbeat and time.monotonic() - self._sent > self.heartbeat:
                self._send(m.encode(m.Heartbeat(), next(self._ids)))  # its reply matches no request: dropped

    def _send(self, frames: list[Any]) -> None:
        """Send without ever blocking the I/O thread: a peer that dropped us (a refused CURVE key) fails every request."""
        try:
            self._dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._lose("dropped this connection (for tcp: is this client's CURVE key authorized, and the server "
                       "key right?)")
            return
        self._sent = time.monotonic()

    def _check_liveness(self) -> None:
        """Probe a silent daemon while requests wait; fail them once it stayed silent too long."""
        with self._lock:
            if not self._pending:
                self._heard = time.monotonic()
                return
            silent = time.monotonic() - self._heard
            if silent <= self.liveness:
                if silent > self.liveness / 2 and self._probe is None:
                    self._probe = next(self._ids)
                    self._send(m.encode(m.Heartbeat(), self._probe))
                return
        self._lose(f"gave no sign of life for {self.liveness:.0f} s; it may have died (what it had copied before "
                   "may still be on disk: check datastates.latest)")

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            header = m.decode_header(frames)
        except DatastatesError as exc:
            log.error("dropping an unreadable reply from the daemon: %s", exc)
            return
        with self._lock:
            if header.parent is not None and header.parent == self._probe:
                self._probe = None
            fut = self._pending.pop(header.parent, None) if header.parent is not None else None
        try:
            m.check_version(header)
            body = m.decode_body(header, frames[1])
        except DatastatesError as exc:
            if fut is not None and not fut.cancelled():
                fut.set_exception(exc)
            return
        if isinstance(body, m.Error) and body.code == UnknownClientError.code and self.registered:
            self._forgotten()
        if fut is None or fut.cancelled():
            return
        if isinstance(body, m.Error):
            fut.set_exception(error_from_code(body.code, body.message, body.detail))
        else:
            fut.set_result(body)

    def _forgotten(self) -> None:
        """The daemon answering does not know this client: fail every other request, as silence would.

        The daemon that holds them is gone (restarted on the same endpoint), or took this
        client as gone; either way no reply will come. Without this, a restarted daemon
        answering the client's heartbeats and probes would keep its requests waiting for ever.
        """
        self._lose("no longer knows this client: it restarted, or took this client as gone; what it had not "
                   "confirmed copied is given up (connect a new Client)")

    def _lose(self, why: str) -> None:
        """This connection's daemon is gone for good: every waiting request fails with DaemonUnavailable(``why``)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self.lost = True
        _fail(pending, lambda: DaemonUnavailable(f"datastatesd at {self.endpoint} {why}", endpoint=self.endpoint))

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._outbox.send(_STOP)
            pending, self._pending = self._pending, {}
        self._thread.join()
        self._outbox.close()
        self._ctx.term()
        _fail(pending, lambda: DaemonUnavailable(f"connection to {self.endpoint} closed before the reply"))


def _fail(pending: dict[int, Future], error: Callable[[], DaemonUnavailable]) -> None:
    """Every request still waiting fails with an ``error()`` of its own; one answered or cancelled keeps its outcome."""
    for fut in pending.values():
        if not fut.done():
            fut.set_exception(error())


def check_listening(endpoint: str) -> None:
    """Raise DaemonNotRunning where the kernel says nothing listens on ``endpoint``; else return.

    A plain ``connect()``, closed at once: for ``ipc://`` the socket file is missing (ENOENT)
    or nobody accepts on it (ECONNREFUSED, a daemon that exited); for ``tcp://`` the host
    refuses the port. Anything else (a host that does not answer, a name that does not
    resolve, a permission) says nothing, and is left to ZeroMQ and the timeouts.
    """
    scheme, _, address = endpoint.partition("://")
    try:
        if scheme == "ipc":
            where = f"the socket file {address}"
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect("\0" + address[1:] if address.startswith("@") else address)  # "@": abstract namespace
        elif scheme == "tcp":
            host, _, port = address.rpartition(":")
            where = f"port {port} of {host}"
            socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S).close()
        return
    except FileNotFoundError:
        why = f"{where} does not exist"
    except ConnectionRefusedError:
        why = f"nothing listens on {where}"
    except (OSError, ValueError):
        return
    raise DaemonNotRunning(
        f"no datastatesd is running at {endpoint} ({why}): start one on this node with `datastatesd` (the default "
        f"config) or `datastatesd --node-config node.yaml`, or point ${ENDPOINT_ENV} (or the endpoint argument) at "
        "the endpoint a running daemon serves", endpoint=endpoint)


def daemon_status(endpoint: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """The daemon's status, without registering as a client.

    Raises DaemonNotRunning at once where no daemon listens on the endpoint, DaemonUnavailable
    where one listens but gives no reply within ``timeout``.
    """
    conn = Connection(resolve_endpoint(endpoint))
    try:
        return conn.call(m.Status(), timeout).status
    finally:
        conn.close()
