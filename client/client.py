"""The thin client a training rank holds: capture, one message, and futures."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from datastates.protocol import messages as m
from datastates.protocol.endpoint import resolve_endpoint
from datastates.protocol.errors import DatastatesError, WaitTimeout
from datastates.protocol.format import check_tag

from .capture import capture
from .connection import Connection

DEFAULT_TIMEOUT = 30.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotHandle:
    """What ``snapshot()`` returns: the daemon's id for the snapshot and what it will write."""

    id: int
    path: str
    tag: str
    nbytes: int


def daemon_status(endpoint: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """The daemon's status, without registering as a client; DaemonUnavailable if none answers."""
    conn = Connection(resolve_endpoint(endpoint))
    try:
        return conn.call(m.Status(), timeout).status
    finally:
        conn.close()


class Client:
    """A connection from one training rank to its node's datastatesd.

    Call order: ``snapshot()`` any number of times, ``wait()`` before anything changes the
    checkpointed tensors in place (the optimizer step), then ``commit(tag)``.
    """

    def __init__(self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT, name: str | None = None) -> None:
        self.endpoint = resolve_endpoint(endpoint)
        self.timeout = timeout
        self._conn = Connection(self.endpoint)
        try:
            welcome = self._conn.call(m.Hello(pid=os.getpid(), name=name or f"pid{os.getpid()}", host=socket.gethostname()), timeout)
        except BaseException:
            self._conn.close()
            raise
        self.client_id: str = welcome.client_id
        self.roots: list[str] = welcome.roots
        self._uncopied: dict[int, list[Any]] = {}

    def snapshot(self, state: Any, path: str | os.PathLike, tag: str | None = None) -> SnapshotHandle:
        """Hand ``state`` to the daemon, to be written to ``path``; returns once the daemon has taken it.

        The daemon copies in the background, so tensors must not change in place until
        ``wait()`` returns. ``tag`` defaults to the name of the path's parent folder.
        """
        path = os.path.abspath(os.fspath(path))
        tag = check_tag(tag if tag is not None else os.path.basename(os.path.dirname(path)))
        cap = capture(state)
        ack = self._conn.call(m.Snapshot(path=path, tag=tag, sources=cap.sources, entries=cap.entries, root=cap.root), self.timeout)
        self._uncopied[ack.snapshot_id] = cap.keepalive
        return SnapshotHandle(id=ack.snapshot_id, path=path, tag=tag, nbytes=ack.total_bytes)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the daemon holds its own copy of every snapshot taken so far."""
        if not self._uncopied:
            return
        ids = list(self._uncopied)
        fut = self._conn.request(m.Wait(snapshot_ids=ids))
        try:
            fut.result(timeout)
        except TimeoutError:
            raise WaitTimeout(f"{len(ids)} snapshot(s) not copied by the daemon within {timeout} s") from None
        finally:
            if fut.done():  # copied or failed: either way reported once, by this wait
                for i in ids:
                    self._uncopied.pop(i, None)

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
        return self._conn.request(m.Commit(tag=check_tag(tag)))

    def status(self) -> dict[str, Any]:
        return self._conn.call(m.Status(), self.timeout).status

    def close(self, timeout: float | None = None) -> None:
        """Leave the daemon once outstanding requests (commits) are answered, or ``timeout`` passes.

        What the daemon has already taken is flushed whether or not the client stays.
        """
        concurrent.futures.wait(self._conn.outstanding(), timeout)
        try:
            self._conn.call(m.Bye(), min(self.timeout, 5.0))
        except DatastatesError as exc:  # the daemon may be gone already; closing still succeeds
            log.info("datastatesd did not acknowledge BYE: %s", exc)
        finally:
            self._conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
