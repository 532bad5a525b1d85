"""Every connection the daemon accepted, by descriptor: those not yet introduced cost a bounded number of them.

ZeroMQ accepts every connection and aborts the whole process when an accept meets the
open-files limit (``Too many open files (src/ipc_listener.cpp)``), and it never drops a peer
that connected and then says nothing, or says anything but HELLO. So the daemon watches its
ROUTER socket's monitor: each accepted connection is recorded with its descriptor as
*unintroduced*, and stays so until a message on it is answered for a registered client (its
HELLO welcomed, or a known client's request on a connection it reconnected). Every message
marks its connection by ZeroMQ's ``SRCFD`` on the frames. An unintroduced connection is shut
(``shutdown(2)`` on its socket; ZeroMQ then closes it as if the peer had left) once it is
``UNINTRODUCED_S`` old without a request served (``datastatesctl status --watch`` and ``wait``
poll without HELLO: shut between two polls, a request on its way would be lost), or, oldest
first, when more than ``max_unintroduced`` are kept or the
daemon's open descriptors reach ``shed_at``: both bounds follow the open-files limit, so a
daemon that may not raise a low hard limit sheds before ZeroMQ meets it. A connection whose
request is being handled (a HELLO being welcomed) is never shut. One answered within
``REPLY_GRACE_S`` is shut after the others, if it is among the newest ``max_replying`` (an
eighth of the bound) so answered: ZeroMQ's I/O thread writes a reply after the handler
returns, seconds after behind a flood, and a shut socket drops what it has not written (a
``datastatesctl status`` amid 2,000 reconnecting peers lost its reply about 3 times in 100).
Only a few, or connections that keep asking would rank every new one first, and a trainer
would be shut before its HELLO. Shutting the oldest gives a new trainer the whole queue's
time to say HELLO even while a flood churns.

Descriptor numbers are reused as soon as ZeroMQ closes one, and the monitor's events arrive
late (behind a flood, seconds late), so a connection is known by its socket's inode: an
introduced one is never taken for a new one by a stale accept event for its number, and a
descriptor is shut only while it is still the socket that was accepted. A number reused by
another socket of the daemon's (the upload process's socket pair, an HTTPS connection to an
object store) is never recorded: a connection counts only if its local address is the
daemon's endpoint, as an accepted one's is (a stale event once shut the upload process's
socket, 10 s after it was made, and so failed a tag's upload).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
import stat
import time
from dataclasses import dataclass
from itertools import chain, islice

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

UNINTRODUCED_S = 10.0
"""How long a connection may stay without its HELLO welcomed, or a request served, before it is shut."""
MAX_UNINTRODUCED = 256
"""The most connections kept that are not introduced yet, where the open-files limit allows that many."""
REPLY_GRACE_S = 2.0
"""How long after a request on it was answered a connection not introduced is shed last (one of the newest
``max_replying``), for its reply to leave."""
SWEEP_S = 0.5
"""How often connections past their time, and closed ones, are looked for (each costs a stat per connection)."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


@dataclass
class _Pending:
    since: float
    inode: int
    spoke: bool = False
    served: bool = False
    """A request on it got an answer other than an error: a tool that polls without HELLO, never shut for its age."""
    busy: int = 0
    """Requests of this connection being handled: it is not shut under them."""
    replied: float = float("-inf")
    """When a request on it was last answered: its reply may still be on its way out (``REPLY_GRACE_S``)."""


def bounds(limit: int) -> tuple[int, int]:
    """(the most unintroduced connections kept, the open descriptors from which they are shed) under ``limit``."""
    return min(MAX_UNINTRODUCED, limit // 4), limit - max(64, limit // 4)


class Connections:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        """``sock``: the daemon's ROUTER socket, bound."""
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._address = _listening(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._pending: dict[int, _Pending] = {}
        """Descriptor → its connection, oldest first, for connections not introduced yet."""
        self._introduced: dict[int, int] = {}
        """Socket inode → descriptor, for connections a registered client speaks on, while that socket is open."""
        self.limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_unintroduced, self.shed_at = bounds(self.limit)
        self.max_replying = max(1, self.max_unintroduced // 8)
        """The most connections answered within ``REPLY_GRACE_S`` that are shed last."""
        self.shut_down = 0
        """Unintroduced connections shut so far, for ``status``."""
        self.shed_near_limit = 0
        """Of those, how many because the open descriptors reached ``shed_at``."""

    def heard(self, fd: int) -> int | None:
        """A message came on connection ``fd``: its socket's inode, to hand to ``answered`` once it is handled."""
        inode = _inode(fd)
        if inode is None or inode in self._introduced:
            return inode
        entry = self._pending.get(fd)
        if entry is None or entry.inode != inode:  # its accept event is still on its way
            if not self._accepted(fd, inode):  # closed since, and the number another socket's
                return None
            entry = self._pending[fd] = _Pending(time.monotonic(), inode, busy=1)
            self._bound()
        else:
            entry.busy += 1
        entry.spoke = True
        return inode

    def answered(self, fd: int, inode: int | None, introduced: bool, served: bool) -> None:
        """The message ``heard`` returned ``inode`` for is handled. ``introduced``: it came from a registered client,
        whose connection this is now; else the connection goes to the end of the queue, is shed last while its reply
        leaves (``REPLY_GRACE_S``), and ``served`` (answered without an error, as ``datastatesctl status --watch`` is)
        spares it the age limit from now on; the bound on their number still holds."""
        entry = self._pending.get(fd)
        if entry is None or entry.inode != inode or inode is None:
            return
        entry.busy -= 1
        del self._pending[fd]
        if introduced:
            self._introduced[inode] = fd
        else:
            self._pending[fd] = entry
            entry.since = entry.replied = time.monotonic()
            entry.served |= served

    def status(self) -> dict[str, int]:
        return {"silent": sum(not e.spoke for e in self._pending.values()),
                "unintroduced": len(self._pending), "max_unintroduced": self.max_unintroduced,
                "shed_at_descriptors": self.shed_at, "shut_down": self.shut_down,
                "shed_near_limit": self.shed_near_limit}

    async def watch(self, stopped: asyncio.Event) -> None:
        """Follow accepts and disconnects; shut connections left unintroduced; until ``stopped``."""
        swept = 0.0
        try:
            while not stopped.is_set():
                if await self._monitor.poll(1000):
                    self._event(parse_monitor_message(await self._monitor.recv_multipart()))
                now = time.monotonic()
                if now - swept < SWEEP_S:
                    continue
                swept = now
                for fd in [fd for fd, e in self._pending.items()
                           if now - e.since > UNINTRODUCED_S and not e.busy and not e.served]:
                    self._shut(fd, f"not introduced in {UNINTRODUCED_S:.0f} s")
                self._pending = {fd: e for fd, e in self._pending.items() if _inode(fd) == e.inode}
                self._introduced = {inode: fd for inode, fd in self._introduced.items() if _inode(fd) == inode}
                self._shed_near_limit()
        finally:
            self._monitor.close(0)

    def _event(self, event: dict) -> None:
        fd = event["value"]
        entry = self._pending.get(fd)
        if event["event"] != zmq.EVENT_ACCEPTED:
            if entry is not None and _inode(fd) != entry.inode:  # its socket is gone, not a later one's
                del self._pending[fd]
            return
        inode = _inode(fd)  # the socket behind fd now: this accept's, or a later one's if the event is stale
        if inode is None or inode in self._introduced or (entry is not None and entry.inode == inode) \
                or not self._accepted(fd, inode):
            return
        self._pending[fd] = _Pending(time.monotonic(), inode)
        self._bound()
        self._shed_near_limit()

    def _bound(self) -> None:
        """Keep at most ``max_unintroduced`` connections, shutting the oldest idle ones."""
        excess = len(self._pending) - self.max_unintroduced
        if excess > 0:
            for fd in self._oldest_idle(excess):
                self._shut(fd, f"over {self.max_unintroduced} connections not introduced")

    def _shed_near_limit(self) -> None:
        """At ``shed_at`` open descriptors, shut unintroduced connections, oldest first, before ZeroMQ meets the limit."""
        over = open_descriptors() - self.shed_at
        if over >= 0:
            for fd in self._oldest_idle(over + 1):
                if self._shut(fd, f"{self.shed_at} of {self.limit} descriptors open"):
                    self.shed_near_limit += 1

    def _oldest_idle(self, n: int) -> list[int]:
        """The ``n`` oldest connections with no request being handled, the newest ``max_replying`` of those answered
        within ``REPLY_GRACE_S`` last."""
        now = time.monotonic()
        idle = [fd for fd, e in self._pending.items() if not e.busy]
        # an answer moves its connection to the end of the queue: the newest answered come last
        replying = set(islice((fd for fd in reversed(idle) if now - self._pending[fd].replied < REPLY_GRACE_S),
                              self.max_replying))
        return list(islice(chain((fd for fd in idle if fd not in replying), (fd for fd in idle if fd in replying)), n))

    def _shut(self, fd: int, why: str) -> bool:
        entry = self._pending.pop(fd)
        sock = _socket(fd, entry.inode)  # None once closed by ZeroMQ and the number reused: not ours to touch
        if sock is None:
            return False
        try:
            with sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        self.shut_down += 1
        if self.shut_down in (1, 10, 100) or self.shut_down % 1000 == 0:
            log.warning("shut down a connection that never said HELLO (%s); %d so far", why, self.shut_down)
        return True


    def _accepted(self, fd: int, inode: int) -> bool:
        """Whether ``fd`` is still socket ``inode``, a connection to the daemon's endpoint (its local address that
        endpoint's)."""
        sock = _socket(fd, inode)
        if sock is None:
            return False
        try:
            with sock:
                name = sock.getsockname()
        except OSError:
            return False
        if isinstance(self._address, int):
            return isinstance(name, tuple) and name[1] == self._address
        return name == self._address


def _listening(endpoint: str) -> str | bytes | int:
    """What an accepted connection's ``getsockname()`` gives for the bound ``endpoint``: an ipc endpoint's path (an
    abstract one's as bytes, with its leading NUL), a tcp endpoint's port."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        return b"\0" + path[1:].encode() if path.startswith("@") else path
    return int(endpoint.rsplit(":", 1)[1])


def _socket(fd: int, inode: int | None = None) -> socket.socket | None:
    """A socket object of its own (on a duplicate) for the socket open as ``fd`` now, and of inode ``inode`` if given;
    None if ``fd`` is closed, or no socket (its number taken since by a file or a folder), or another socket. The
    duplicate is checked, not the number (which another thread may reuse meanwhile), and never outlives the object:
    one leaked of a folder's descriptor kept the flock a commit took on it, and that folder's next commit waited
    forever."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        st = os.fstat(dup)
        if stat.S_ISSOCK(st.st_mode) and inode in (None, st.st_ino):
            return socket.socket(fileno=dup)
    except OSError:
        pass
    os.close(dup)
    return None


def _inode(fd: int) -> int | None:
    """The inode of the socket open as ``fd`` now, or None once it is closed."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def open_descriptors() -> int:
    """This process's open descriptors."""
    return len(os.listdir("/proc/self/fd"))
