"""A buggy or hostile client names something other than its own segment.

A FIFO named as a shared-memory segment used to block the daemon's admission in ``open``
until some writer came: a well-behaved client's ``wait()`` then timed out while ``status``
still answered, and SIGTERM could not stop the daemon. Now it is refused at once, and the
daemon serves everyone else and stops cleanly.
"""

from __future__ import annotations

import os
import uuid
from typing import Callable

import torch

import datastates
from datastates.client import Client, daemon_status

from conftest import DaemonProc, RawPeer, assert_state_equal, save

SKELETON = b"\x80\x02K\x00Q."  # pickle protocol 2: persistent id 0, the one tensor entry
TENSOR = {"storage": 0, "dtype": "float32", "shape": [100], "stride": [1], "storage_offset": 0,
          "requires_grad": False, "parameter": False}


def test_a_fifo_named_as_a_segment_is_refused_at_once_and_the_daemon_serves_and_stops(
        start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    fifo = f"/dev/shm/ds-test-fifo-{uuid.uuid4().hex[:8]}"
    os.mkfifo(fifo, 0o600)
    peer = RawPeer(d.endpoint)
    try:
        _, welcome = peer.request("hello", {"pid": os.getpid(), "name": "hostile"})
        assert "client_id" in welcome
        snapshot = {"path": str(d.root / "fifo" / "m.pt"), "tag": "fifo", "root": 1,
                    "sources": [{"kind": "shm", "handle": os.path.basename(fifo), "nbytes": 400}],
                    "entries": [{"provider": "tensor", "name": "w", "meta": TENSOR},
                                {"provider": "pickle", "name": "<skeleton>", "meta": {"data": SKELETON}}]}
        _, body = peer.request("snapshot", snapshot, 2)
        assert body["code"] == "shared_memory" and "not a regular file" in body["message"], body
    finally:
        peer.close()
        os.unlink(fifo)
    with Client(d.endpoint, timeout=60) as c:  # everyone else is served
        state = {"w": torch.randn(100)}
        save(c, state, d.root / "after" / "m.pt")
        assert_state_equal(state, datastates.load(d.root / "after" / "m.pt"))
    assert d.stop() == 0  # SIGTERM drains and stops: no admission thread is stuck


def test_a_segment_truncated_after_admission_fails_that_snapshot_alone(start_daemon: Callable[..., DaemonProc]) -> None:
    """The daemon used to map segments, and a client that shrank its own after admission killed it with SIGBUS.

    Now it reads them through a descriptor: the short read fails that one snapshot, and the daemon serves on.
    """
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1)
    size = 256 << 20
    name = f"ds-test-shrink-{uuid.uuid4().hex[:8]}"
    segment = f"/dev/shm/{name}"
    with open(segment, "wb") as f:
        f.truncate(size + 64)  # torch's 64-byte prefix, then the storage
    peer = RawPeer(d.endpoint)
    try:
        peer.request("hello", {"pid": os.getpid(), "name": "shrinker"})
        meta = dict(TENSOR, dtype="uint8", shape=[size])
        snapshot = {"path": str(d.root / "shrunk" / "m.pt"), "tag": "shrunk", "root": 1,
                    "sources": [{"kind": "shm", "handle": name, "nbytes": size}],
                    "entries": [{"provider": "tensor", "name": "w", "meta": meta},
                                {"provider": "pickle", "name": "<skeleton>", "meta": {"data": SKELETON}}]}
        _, ack = peer.request("snapshot", snapshot, 2)
        assert ack.get("snapshot_id"), ack
        os.truncate(segment, 0)
        job = next(j for j in daemon_status(d.endpoint)["snapshots"] if j["id"] == ack["snapshot_id"])
        assert job["copied_bytes"] < job["total_bytes"], "the truncation came after the copy: nothing was tried"
        _, body = peer.request("wait", {"snapshot_ids": [ack["snapshot_id"]]}, 3)
        assert body["code"] == "snapshot_failed" and "shrank" in body["message"], body
    finally:
        peer.close()
        os.unlink(segment)
    assert d.proc.poll() is None, "the daemon died"
    assert not (d.root / "shrunk" / "m.pt").exists()
    with Client(d.endpoint, timeout=60, cpu_capture="shm") as c:  # everyone else is served, through shm too
        state = {"w": torch.randn(100)}
        save(c, state, d.root / "after-shrink" / "m.pt")
        assert_state_equal(state, datastates.load(d.root / "after-shrink" / "m.pt"))
