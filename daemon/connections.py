"""Every connection the daemon accepted, by descriptor: silent ones cost a bounded number of them.

ZeroMQ accepts every connection and aborts the whole process when an accept meets the
open-files limit (``Too many open files (src/ipc_listener.cpp)``), and it never drops a peer
that connected and then says nothing. So the daemon watches its ROUTER socket's monitor:
each accepted connection is recorded with its descriptor, every message marks its
connection as one that spoke (ZeroMQ's ``SRCFD`` on the frames), and a connection still
silent after ``SILENT_S``, or beyond the ``MAX_SILENT`` newest silent ones, is shut down
(``shutdown(2)`` on its socket; ZeroMQ then closes it as if the peer had left). A client
that spoke once (HELLO) is the client registry's to watch, not this.

A descriptor is shut only while it is still the socket that was accepted (same inode), so
a number ZeroMQ closed and reused meanwhile is never touched.
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
"""The most connections kept that have not sent anything yet; the newest beyond it is shut at once."""
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


class Connections:
    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self._monitor = sock.get_monitor_socket(_EVENTS)
        self._silent: dict[int, tuple[float, int]] = {}
        """Descriptor → (when accepted, its inode), for connections that have not spoken yet."""
        self._spoke_early: set[int] = set()
        """Connections whose first message came before the monitor reported their accept."""
        self.shut_down = 0
        """Silent connections shut so far, for ``status``."""

    def heard(self, fd: int) -> None:
        """A message came on connection ``fd``: it is a peer, no longer a silent one."""
        if self._silent.pop(fd, None) is None:
            self._spoke_early.add(fd)

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
        finally:
            self._monitor.close(0)

    def _event(self, event: dict) -> None:
        fd = event["value"]
        if event["event"] == zmq.EVENT_ACCEPTED:
            if fd in self._spoke_early:
                self._spoke_early.discard(fd)
                return
            try:
                self._silent[fd] = (time.monotonic(), os.fstat(fd).st_ino)
            except OSError:
                return
            if len(self._silent) > MAX_SILENT:
                self._shut(fd, f"over {MAX_SILENT} silent connections")
        else:
            self._silent.pop(fd, None)
            self._spoke_early.discard(fd)

    def _shut(self, fd: int, why: str) -> None:
        _since, inode = self._silent.pop(fd)
        try:
            if os.fstat(fd).st_ino != inode:
                return  # closed by ZeroMQ and the number reused: not ours to touch
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        self.shut_down += 1
        if self.shut_down in (1, 10, 100) or self.shut_down % 1000 == 0:
            log.warning("shut down a connection that never sent anything (%s); %d so far", why, self.shut_down)
