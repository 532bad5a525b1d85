"""The daemon reading a trainer's CPU memory in place: who it reads, and what a bad address does.

For the default CPU capture path (daemon/sources/vm.py), a raw
client (``RawPeer``) plays the buggy or hostile trainer of the same user:

- a client that claims another process's pid, or the daemon's own, is never read in place,
  and a ``vm`` source from it is refused;
- an address that is not mapped, or one unmapped after admission (what truncating a segment
  was for shared memory: a SIGBUS that killed the daemon), fails that snapshot alone with a
  clear error; the daemon serves everyone else and holds no descriptor for any of it.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import subprocess
import sys
import time
from typing import Any, Callable

import torch

import datastates
from datastates.client import Client
from datastates.protocol.liveness import pid_namespace, process_start

from conftest import DaemonProc, RawPeer, assert_state_equal, save

SKELETON = b"\x80\x02K\x00Q."  # pickle protocol 2: persistent id 0, the one tensor entry


def hello(peer: RawPeer, pid: int, probe: str) -> dict[str, Any]:
    _, welcome = peer.request("hello", {"pid": pid, "name": "raw", "host": os.uname().nodename,
                                        "pidns": pid_namespace(), "started": process_start(pid) or "",
                                        "probe": probe})
    assert "client_id" in welcome, welcome
    return welcome


def vm_snapshot(d: DaemonProc, name: str, address: int, nbytes: int) -> dict[str, Any]:
    meta = {"storage": 0, "dtype": "uint8", "shape": [nbytes], "stride": [1], "storage_offset": 0,
            "requires_grad": False, "parameter": False}
    return {"path": str(d.root / name / "m.pt"), "tag": name, "root": 1,
            "sources": [{"kind": "vm", "handle": f"{address:x}", "nbytes": nbytes}],
            "entries": [{"provider": "tensor", "name": "w", "meta": meta},
                        {"provider": "pickle", "name": "<skeleton>", "meta": {"data": SKELETON}}]}


class OwnProbe:
    """Bytes in this test process, offered as a probe: right for our pid, wrong for any other."""

    def __init__(self) -> None:
        self.buf = ctypes.create_string_buffer(os.urandom(16), 16)

    def __str__(self) -> str:
        return f"{ctypes.addressof(self.buf):x}:{self.buf.raw.hex()}"


def daemon_serves(d: DaemonProc, name: str) -> None:
    with Client(d.endpoint, timeout=60) as c:
        state = {"w": torch.randn(1000)}
        save(c, state, d.root / name / "m.pt")
        assert_state_equal(state, datastates.load(d.root / name / "m.pt"))


def test_a_client_claiming_another_process_is_not_read_in_place(shared_daemon: DaemonProc) -> None:
    d = shared_daemon
    probe = OwnProbe()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    peer = RawPeer(d.endpoint)
    try:
        assert hello(peer, os.getpid(), str(probe))["vm_refused"] == "", "our own pid and probe must pass"
        welcome = hello(peer, other.pid, str(probe))  # same user, same namespace, but not the sender
        assert welcome["vm_refused"], "a client claiming another process's pid is read in place"
        _, body = peer.request("snapshot", vm_snapshot(d, "claimed", ctypes.addressof(probe.buf), 16), 2)
        assert body["code"] == "invalid_request" and "cannot read" in body["message"], body

        daemon_pid = datastates.client.daemon_status(d.endpoint)["daemon"]["pid"]
        welcome = hello(peer, daemon_pid, str(probe))
        assert "daemon's own pid" in welcome["vm_refused"], welcome
    finally:
        peer.close()
        other.kill()
        other.wait()
    daemon_serves(d, "after-claims")


def test_an_address_not_mapped_fails_that_snapshot_alone(shared_daemon: DaemonProc) -> None:
    d = shared_daemon
    probe = OwnProbe()
    hole = mmap.mmap(-1, 1 << 20)
    address = ctypes.addressof(ctypes.c_char.from_buffer(hole))
    hole.close()  # unmapped now: what a freed or truncated buffer looks like to the daemon
    peer = RawPeer(d.endpoint)
    try:
        assert hello(peer, os.getpid(), str(probe))["vm_refused"] == ""
        _, ack = peer.request("snapshot", vm_snapshot(d, "unmapped", address, 1 << 20), 2)
        assert ack.get("snapshot_id"), ack
        _, body = peer.request("wait", {"snapshot_ids": [ack["snapshot_id"]]}, 3)
        assert body["code"] == "snapshot_failed" and "no longer mapped" in body["message"], body
        assert not (d.root / "unmapped" / "m.pt").exists()
    finally:
        peer.close()
    daemon_serves(d, "after-unmapped")


def test_memory_unmapped_mid_copy_fails_that_snapshot_alone(start_daemon: Callable[..., DaemonProc]) -> None:
    """256 MiB through a 4 MiB pool; the client unmaps it right after admission, as a truncated segment did."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1)
    probe = OwnProbe()
    size = 256 << 20
    region = mmap.mmap(-1, size)
    region.write(b"\x07" * size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    peer = RawPeer(d.endpoint)
    try:
        assert hello(peer, os.getpid(), str(probe))["vm_refused"] == ""
        _, ack = peer.request("snapshot", vm_snapshot(d, "shrunk", address, size), 2)
        assert ack.get("snapshot_id"), ack
        region.close()  # no exported pointers remain: the pages go now
        job = next(j for j in datastates.client.daemon_status(d.endpoint)["snapshots"] if j["id"] == ack["snapshot_id"])
        assert job["copied_bytes"] < job["total_bytes"], "the unmapping came after the copy: nothing was tried"
        _, body = peer.request("wait", {"snapshot_ids": [ack["snapshot_id"]]}, 3)
        assert body["code"] == "snapshot_failed" and "no longer mapped" in body["message"], body
    finally:
        peer.close()
    for _ in range(300):
        if not (d.root / "shrunk").exists() or not any((d.root / "shrunk").iterdir()):
            break
        time.sleep(0.1)
    assert not (d.root / "shrunk" / "m.pt").exists()
    daemon_serves(d, "after-shrunk")
    fds = os.listdir(f"/proc/{d.proc.pid}/fd")
    assert len(fds) < 64, f"the daemon holds {len(fds)} descriptors after in-place snapshots"


def test_an_unmapped_tensor_among_thousands_of_small_ones_fails_that_snapshot_and_names_it(
        shared_daemon: DaemonProc) -> None:
    """Small tensors are read many to a system call (``VmRegion.read_batch``): one unmapped among them fails the
    snapshot with its own address, and the same tensors all mapped are saved whole."""
    d = shared_daemon
    probe = OwnProbe()
    n, size = 3000, 64
    block = mmap.mmap(-1, n * size)
    block.write(bytes(range(256)) * (n * size // 256))
    base = ctypes.addressof(ctypes.c_char.from_buffer(block))
    hole = mmap.mmap(-1, mmap.PAGESIZE)
    hole_at = ctypes.addressof(ctypes.c_char.from_buffer(hole))
    hole.close()

    def snapshot(name: str, addresses: list[int]) -> dict[str, Any]:
        meta = {"dtype": "uint8", "shape": [size], "stride": [1], "storage_offset": 0, "requires_grad": False,
                "parameter": False}
        return {"path": str(d.root / name / "m.pt"), "tag": name, "root": len(addresses),
                "sources": [{"kind": "vm", "handle": f"{a:x}", "nbytes": size} for a in addresses],
                "entries": [{"provider": "tensor", "name": f"t{i}", "meta": {**meta, "storage": i}}
                            for i in range(len(addresses))]
                + [{"provider": "pickle", "name": "<skeleton>", "meta": {"data": skeleton(len(addresses))}}]}

    addresses = [base + i * size for i in range(n)]
    peer = RawPeer(d.endpoint)
    try:
        assert hello(peer, os.getpid(), str(probe))["vm_refused"] == ""
        broken = addresses[:1777] + [hole_at] + addresses[1778:]
        for msg_id, (name, sources) in enumerate([("with-hole", broken), ("all-mapped", addresses)]):
            _, ack = peer.request("snapshot", snapshot(name, sources), 2 + 2 * msg_id)
            assert ack.get("snapshot_id"), ack
            _, body = peer.request("wait", {"snapshot_ids": [ack["snapshot_id"]]}, 3 + 2 * msg_id)
            if name == "with-hole":
                assert body["code"] == "snapshot_failed" and f"{hole_at:#x}" in body["message"], body
        _, committed = peer.request("commit", {"tag": "all-mapped"}, 6)
        assert committed.get("tag") == "all-mapped", committed
        loaded = torch.load(d.root / "all-mapped" / "m.pt", weights_only=True)
        expect = torch.frombuffer(bytearray(block), dtype=torch.uint8).view(n, size)
        wrong = [i for i in range(n) if not torch.equal(loaded[i], expect[i])]
        assert not wrong, f"{len(wrong)} of {n} tensors differ, the first at index {wrong[0]}"
    finally:
        peer.close()
        block.close()
    daemon_serves(d, "after-batched-hole")


def skeleton(n: int) -> bytes:
    """A protocol-2 skeleton of a list of the entries 0..n-1 (persistent ids, as the client's capture writes)."""
    class Ids(pickle.Pickler):
        def persistent_id(self, obj: Any) -> int | None:
            return obj.index if isinstance(obj, Leaf) else None

    class Leaf:
        def __init__(self, index: int) -> None:
            self.index = index

    buf = io.BytesIO()
    Ids(buf, protocol=2).dump([Leaf(i) for i in range(n)])
    return buf.getvalue()
