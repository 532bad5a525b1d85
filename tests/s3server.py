"""A real S3 server for the tests (moto_server, a process of its own) and a fault proxy in front of it.

``Moto`` starts ``moto_server`` on a free port and waits until it answers. ``FaultProxy`` is a small
threaded HTTP server that forwards every request to a server as it came (the body, the headers, the
signature: nothing is re-signed) and, for the requests a rule matches, delays the answer or answers
503 with S3's XML error body instead of forwarding; ``down()`` makes it refuse every connection, as
a server that stopped.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

MOTO_SERVER = str(Path(sys.executable).parent / "moto_server")

UNAVAILABLE = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable</Code>'
               b'<Message>Please reduce your request rate.</Message><RequestId>fault</RequestId></Error>')
DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
          b'<Message>Access Denied</Message><RequestId>fault</RequestId></Error>')
REFUSALS = {503: UNAVAILABLE, 403: DENIED}


BUSY_EVERY_S = 5.0
"""How often a ``busy`` rule's held request gets an interim answer: well within the clients' read timeout."""
HOLD_MAX_S = 45.0
"""The longest a held request waits, should a test never release it: longer than the clients' read timeout, so a
request held that long fails its tries, as on a hung server (``hang``: however long)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


class Moto:
    """One moto_server process; ``env``: variables of its own (INITIAL_NO_AUTH_ACTION_COUNT: IAM auth)."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen([MOTO_SERVER, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 60
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not start ({self.proc.poll()}):\n{log.read_text()}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@dataclass
class Rule:
    """What to do to the requests ``match`` (method, path, query) accepts: ``delay`` seconds before forwarding,
    ``status`` (503, retried; 403, not) to the first ``fail`` of them (-1: all)."""

    match: Callable[[str, str, str], bool]
    delay: float = 0.0
    fail: int = 0
    status: int = 503
    body: bytes = b""
    """The refusal's body, if not the one for its status."""
    hold: bool = False
    """Keep each matching request waiting (unanswered, in flight) until ``release``, HOLD_MAX_S at most."""
    busy: bool = False
    """While a request is held (``hold``, ``hang``), an interim ``100 Continue`` every BUSY_EVERY_S: the client's read
    timeout never fires, as for a server that keeps the connection busy and never answers; only the client's own
    bounds end its wait."""
    hang: bool = False
    """Keep each matching request waiting, silent, until ``release`` (the proxy's ``clear``, ``release`` or ``down``),
    however long: a hung server."""
    seen: int = 0
    failed: int = 0
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


def upload_part(method: str, path: str, query: str) -> bool:
    return method == "PUT" and "partNumber=" in query and "uploadId=" in query


def any_request(method: str, path: str, query: str) -> bool:
    return True


class FaultProxy:
    """Forwards to ``upstream`` (host, port); ``rules`` apply in order, the first that matches."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream = upstream_port
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str, int, int]] = []
        """(method, path, query, status, body bytes sent) of every request answered."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                path, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rule = proxy._rule(self.command, path, query)
                if rule is not None and (rule.hold or rule.hang):
                    self._held(rule)
                if rule is not None and rule.delay:
                    time.sleep(rule.delay)
                if rule is not None and (rule.fail < 0 or rule.failed < rule.fail):
                    with proxy.lock:
                        rule.failed += 1
                    self._answer(rule.status, {"Content-Type": "application/xml"}, rule.body or REFUSALS[rule.status],
                                 path, query)
                    return
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream, timeout=120)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive", "expect")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                    dropped = ("transfer-encoding", "connection", "keep-alive") + (() if self.command == "HEAD" else ("content-length",))
                    out = {k: v for k, v in reply.getheaders() if k.lower() not in dropped}
                    conn.close()
                except OSError:  # the server is gone: so is this connection, as a dead server's would be
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._answer(reply.status, out, data, path, query, head=self.command == "HEAD")

            def _held(self, rule: Rule) -> None:
                """Until ``rule`` is released (HOLD_MAX_S at most, unless it hangs): silent, or ``busy``."""
                until = None if rule.hang else time.monotonic() + HOLD_MAX_S
                while True:
                    left = None if until is None else until - time.monotonic()
                    step = BUSY_EVERY_S if rule.busy and (left is None or left > BUSY_EVERY_S) else left
                    if rule.released.wait(step) or (left is not None and step == left):
                        return
                    with contextlib.suppress(OSError):  # the client gave up: its answer goes nowhere either
                        self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")

            def _answer(self, status: int, headers: dict[str, str], data: bytes, path: str, query: str,
                        head: bool = False) -> None:
                with proxy.lock:
                    proxy.requests.append((self.command, path, query, status, 0 if head else len(data)))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                if not head or "content-length" not in {k.lower() for k in headers}:
                    self.send_header("Content-Length", str(len(data)))
                try:
                    self.end_headers()
                    if not head:
                        self.wfile.write(data)
                except OSError:
                    # the client gave up on a held request: no traceback from this thread (one printed while pytest
                    # rendered a failure broke pytest: CPython 3.11's ast is not safe in two threads at once)
                    self.close_connection = True

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _rule(self, method: str, path: str, query: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.match(method, path, query):
                    rule.seen += 1
                    return rule
        return None

    def add(self, rule: Rule) -> Rule:
        with self.lock:
            self.rules.append(rule)
        return rule

    def release(self) -> None:
        """Let every held request go on."""
        with self.lock:
            for rule in self.rules:
                rule.release()

    def clear(self) -> None:
        self.release()
        with self.lock:
            self.rules.clear()

    def count(self, match: Callable[[str, str, str], bool], status: int | None = None) -> int:
        with self.lock:
            return sum(1 for m, p, q, s, _ in self.requests if match(m, p, q) and (status is None or s == status))

    def answered(self, path: str) -> list[tuple[str, int]]:
        """(method, body bytes sent) of every request answered for ``path``, in order."""
        with self.lock:
            return [(m, n) for m, p, _, _, n in self.requests if p == path]

    def down(self) -> None:
        """Stop listening: every new connection is refused, as to a server that stopped."""
        self.release()  # no handler thread left waiting on a hung rule
        if self.server.socket.fileno() < 0:
            return
        self.server.shutdown()
        self.server.server_close()
