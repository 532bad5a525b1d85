"""Every connection the daemon accepted, by descriptor: silent ones cost a bounded number of them.

ZeroMQ accepts every connection and aborts the whole process when an accept meets the
open-files limit (``Too many open files (src/ipc_listener.cpp)``), and it never drops a peer
that connected and then says nothing. So the daemon watches its ROUTER socket's monitor:
each accepted connection is recorded with its descriptor, every message marks its
connection as one that spoke (ZeroMQ's ``SRCFD`` on the frames), and a connection still
silent after ``SILENT_S``, or the oldest one once more than ``MAX_SILENT`` are silent, is
shut down (``shutdown(2)`` on its socket; ZeroMQ then closes it as if the peer had left).
Shutting the oldest gives a new trainer the whole queue's time to say HELLO even while a
flood of silent peers churns. A client that spoke once (HELLO) is the client registry's to
watch, not this.

Descriptor numbers are reused as soon as ZeroMQ closes one, and the monitor's events arrive
late (behind a flood, seconds late), so a connection is known by its socket's inode: one
that spoke is never taken for silent by a stale accept event for its number, and a
descriptor is shut only while it is still the socket that was accepted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

SILENT_S = 10.0
"""How long a connection may stay without sending anything before it is shut."""
MAX_SILENT = 256
"""The most connections kept that have not sent anything yet; beyond it the oldest is shut at once."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class Connections:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._silent: dict[int, tuple[float, int]] = {}
        """Descriptor → (when accepted, its socket's inode), oldest first, for connections that have not spoken."""
        self._spoke: dict[int, int] = {}
        """Socket inode → descriptor, for connections that sent a message, while that socket is open."""
        self.shut_down = 0
        """Silent connections shut so far, for ``status``."""

    def heard(self, fd: int) -> None:
        """A message came on connection ``fd``: it is a peer, no longer a silent one."""
        inode = _inode(fd)
        if inode is None:
            return
        self._spoke[inode] = fd
        if self._silent.get(fd, (0.0, None))[1] == inode:
            del self._silent[fd]

    def status(self) -> dict[str, int]:
        return {"silent": len(self._silent), "silent_shut_down": self.shut_down}

    async def watch(self, stopped: asyncio.Event) -> None:
        """Follow accepts and disconnects; shut silent connections; until ``stopped``."""
        try:
            while not stopped.is_set():
                if await self._monitor.poll(1000):
                    self._event(parse_monitor_message(await self._monitor.recv_multipart()))
                now = time.monotonic()
                for fd in [fd for fd, (since, _) in self._silent.items() if now - since > SILENT_S]:
                    self._shut(fd, f"silent for {SILENT_S:.0f} s")
                self._spoke = {inode: fd for inode, fd in self._spoke.items() if _inode(fd) == inode}
        finally:
            self._monitor.close(0)

    def _event(self, event: dict) -> None:
        fd = event["value"]
        if event["event"] != zmq.EVENT_ACCEPTED:
            self._silent.pop(fd, None)
            return
        inode = _inode(fd)  # the socket behind fd now: this accept's, or a later one's if the event is stale
        if inode is None or inode in self._spoke or self._silent.get(fd, (0.0, None))[1] == inode:
            return
        self._silent[fd] = (time.monotonic(), inode)
        if len(self._silent) > MAX_SILENT:
            self._shut(next(iter(self._silent)), f"over {MAX_SILENT} silent connections")

    def _shut(self, fd: int, why: str) -> None:
        _since, inode = self._silent.pop(fd)
        if _inode(fd) != inode:
            return  # closed by ZeroMQ and the number reused: not ours to touch
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        self.shut_down += 1
        if self.shut_down in (1, 10, 100) or self.shut_down % 1000 == 0:
            log.warning("shut down a connection that never sent anything (%s); %d so far", why, self.shut_down)


def _inode(fd: int) -> int | None:
    """The inode of the socket open as ``fd`` now, or None once it is closed."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None
