"""CUDA IPC handles from an untrusted client, on any machine: each bad field is a clear refusal, and service goes on.

The handles go to a real daemon over the wire, as a buggy or hostile client would send
them. No CUDA is needed: the daemon checks every field before it touches a device, and a
daemon without one refuses a well-formed GPU snapshot by saying so.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import torch

from datastates.client import daemon_status
from datastates.client.cuda import encode_handle
from datastates.protocol.descriptors import CUDA_IPC

from conftest import DaemonProc, RawPeer
from test_refusals import assert_still_serves

NBYTES = 4096


def fields(**change: Any) -> dict[str, Any]:
    """A well-formed description of a 4 KiB storage in a block of some GPU (its ref-counter file does not exist)."""
    good = {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "block": b"\x03c" + b"\x01" * 64, "offset": 512,
            "nbytes": NBYTES, "ref_counter": f"/torch_{os.getpid()}_1_0".encode(), "ref_counter_offset": 3}
    return {**good, **change}


def snapshot(peer: RawPeer, root: str, handle: str, nbytes: int = NBYTES, msg_id: int = 2,
             fences: list[dict[str, Any]] | None = None, path: str = "gpu/model.pt") -> dict:
    tensor = {"provider": "tensor", "name": "w", "meta": {
        "storage": 0, "dtype": "uint8", "shape": [nbytes], "stride": [1], "storage_offset": 0,
        "requires_grad": False, "parameter": False}}
    body = {"path": f"{root}/{path}", "tag": path.split("/")[0], "root": 1, "fences": fences or [],
            "sources": [{"kind": CUDA_IPC, "handle": handle, "nbytes": nbytes}],
            "entries": [tensor, {"provider": "pickle", "name": "<skeleton>", "meta": {"data": b"\x80\x02N."}}]}
    _, reply = peer.request("snapshot", body, msg_id=msg_id)
    return reply


@pytest.fixture
def peer(shared_daemon: DaemonProc) -> Iterator[RawPeer]:
    p = RawPeer(shared_daemon.endpoint)
    _, welcome = p.request("hello", {"pid": os.getpid(), "name": "raw-gpu"})
    assert "client_id" in welcome
    yield p
    p.close()


def raw(obj: Any) -> str:
    return base64.urlsafe_b64encode(msgpack.packb(obj, use_bin_type=True)).decode()


BAD = {
    "not base64": ("%%%not-base64%%%", "bad CUDA IPC handle"),
    "not msgpack": (base64.urlsafe_b64encode(b"\xc1\xc1").decode(), "bad CUDA IPC handle"),
    "a list": (raw([1, 2, 3]), "holds exactly the fields"),
    "a field missing": (raw({k: v for k, v in fields().items() if k != "block"}), "holds exactly the fields"),
    "an extra field": (encode_handle(fields(pid=1)), "holds exactly the fields"),
    "offset a string": (encode_handle(fields(offset="512")), "offset must be int"),
    "nbytes a bool": (encode_handle(fields(nbytes=True)), "nbytes must be int"),
    "negative offset": (encode_handle(fields(offset=-1)), "offset must be >= 0"),
    "zero bytes": (encode_handle(fields(nbytes=0)), "nbytes > 0"),
    "slot out of the file": (encode_handle(fields(ref_counter_offset=10000)), "ref_counter_offset outside"),
    "ref counter escaping /dev/shm": (encode_handle(fields(ref_counter=b"../../etc/passwd")), "bad ref-counter name"),
    "ref counter not text": (encode_handle(fields(ref_counter=b"\xff\xfe")), "not a shared-memory name"),
    "size disagreeing with the source": (encode_handle(fields(nbytes=NBYTES * 2)), "names 8192 bytes, the source 4096"),
    "too long": ("A" * 9000, "longer than 8192"),
    # torch reads 64 bytes from a cudaMalloc block handle whatever its length
    "a short block handle": (encode_handle(fields(block=b"\x03c" + b"\x01" * 10)), "block handle is 66 bytes"),
    "another process's ref counter": (encode_handle(fields(ref_counter=b"/torch_1_1_0")),
                                      "not a ref-counter file of the client's own process"),
    "an unknown block type": (encode_handle(fields(block=b"\x03z" + b"\x01" * 64)), "unknown block handle type"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_cuda_handle_is_an_invalid_request_naming_the_field(
        case: str, peer: RawPeer, shared_daemon: DaemonProc) -> None:
    handle, message = BAD[case]
    reply = snapshot(peer, str(shared_daemon.root), handle)
    assert reply.get("code") == "invalid_request", reply
    assert message in reply["message"], reply["message"]
    assert not (shared_daemon.root / "gpu" / "model.pt").exists()


def test_a_well_formed_gpu_snapshot_is_refused_clearly_and_service_goes_on(
        peer: RawPeer, shared_daemon: DaemonProc) -> None:
    """Without a GPU the daemon says it sees none; with one, the forged block's ref-counter file is missing."""
    reply = snapshot(peer, str(shared_daemon.root), encode_handle(fields()))
    assert reply.get("code") == "shared_memory", reply
    expected = "cannot open CUDA IPC ref-counter file" if torch.cuda.is_available() else "sees no CUDA device"
    assert expected in reply["message"], reply["message"]
    assert not (shared_daemon.root / "gpu" / "model.pt").exists()
    assert_still_serves(shared_daemon)


def test_a_fence_whose_event_handle_is_not_64_bytes_is_refused(peer: RawPeer, shared_daemon: DaemonProc) -> None:
    """torch reads 64 bytes from an event handle whatever its length: a short one would be read past its end."""
    fence = {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "event": b"\x01" * 10}
    reply = snapshot(peer, str(shared_daemon.root), encode_handle(fields()), fences=[fence], path="fenced/model.pt")
    assert reply.get("code") == "invalid_request", reply
    assert "event handle is 64 bytes, not 10" in reply["message"]
    assert_still_serves(shared_daemon)


@pytest.fixture
def ref_counter() -> Iterator[tuple[str, torch.Tensor]]:
    """A reference-counter file as torch makes one for a trainer's CUDA shares (a RefcountedMapAllocator file of
    10,000 int64 slots, named after this process), and its slots as torch itself sees them."""
    storage = torch.UntypedStorage._new_using_filename_cpu(8 * 10000)
    name = storage._share_filename_cpu_()[1].decode()
    slots = torch.empty(0, dtype=torch.uint8).set_(storage).view(torch.int64)
    slots.zero_()
    yield name, slots


def test_a_gpu_snapshot_the_daemon_never_opens_releases_each_slot_exactly_once(
        peer: RawPeer, shared_daemon: DaemonProc, ref_counter: tuple[str, torch.Tensor], tmp_path: Path) -> None:
    """A slot left at 1 parks the trainer's block for ever once it frees the tensor; one at -1 too (torch reads
    it unsigned). Refused for want of a GPU (or, with one, for the forged block), refused before any open (a
    path outside the roots), sent again, or probed: each handle's slot ends at exactly 0, as torch reads it,
    and no other slot changes (the last one of the file too)."""
    name, slots = ref_counter
    for k in (3, 4, 5, 9999):
        slots[k] = 1  # as _share_cuda_ sets the slot it hands out
    h3, h4, last = (encode_handle(fields(ref_counter=name.encode(), ref_counter_offset=k)) for k in (3, 4, 9999))
    root = str(shared_daemon.root)
    assert snapshot(peer, root, h3, path="unopened1/model.pt", msg_id=2).get("code") == "shared_memory"
    assert int(slots[3]) == 0
    assert snapshot(peer, root, h3, path="unopened2/model.pt", msg_id=3).get("code") == "shared_memory"
    assert int(slots[3]) == 0, "a handle sent again was released twice"
    outside = snapshot(peer, str(tmp_path), h4, path="elsewhere/model.pt", msg_id=4)
    assert outside.get("code") == "path_not_allowed", outside
    assert int(slots[4]) == 0
    assert snapshot(peer, root, last, path="unopened3/model.pt", msg_id=5).get("code") == "shared_memory"
    assert int(slots[9999]) == 0
    probe = encode_handle(fields(ref_counter=name.encode(), ref_counter_offset=5, nbytes=64))
    _, reply = peer.request("cuda_probe", {"handle": probe, "expect": b"\x00" * 64}, msg_id=6)
    assert reply.get("refused"), reply
    assert int(slots[5]) == 0
    assert int(slots.count_nonzero()) == 0, "the daemon wrote a slot it was not asked about"
    clients = daemon_status(shared_daemon.endpoint)["clients"]
    assert any(c["gpu_capture"].get(fields()["uuid"], "").startswith("refused: ") for c in clients)


def test_a_handle_naming_another_processs_counters_is_refused_and_they_stay_untouched(
        peer: RawPeer, shared_daemon: DaemonProc, ref_counter: tuple[str, torch.Tensor]) -> None:
    """A client may only name its own ref-counter files: not another rank's, whose slots it would move."""
    name, slots = ref_counter
    slots[7] = 1
    other = name.replace(f"torch_{os.getpid()}_", f"torch_{os.getpid() + 1}_")
    os.link(f"/dev/shm{name}", f"/dev/shm{other}")  # the same file, as another process's name
    try:
        reply = snapshot(peer, str(shared_daemon.root), encode_handle(fields(ref_counter=other.encode(),
                                                                               ref_counter_offset=7)),
                         path="foreign/model.pt")
        assert reply.get("code") in ("invalid_request", "shared_memory"), reply
        assert int(slots[7]) == 1
    finally:
        os.unlink(f"/dev/shm{other}")


def test_a_snapshot_from_a_client_taken_as_gone_gives_back_its_new_handles_slots(
        start_daemon: Callable[..., DaemonProc], ref_counter: tuple[str, torch.Tensor]) -> None:
    """A trainer stalled past client_timeout is dropped; a snapshot it sends afterwards is refused as from an
    unknown client. Its handles the daemon never saw must not keep their slots at 1 (each such block would stay
    parked for the trainer's lifetime), and a handle released already, when it was refused earlier, must not go
    below zero (torch reads the slot unsigned: -1 parks it for good too)."""
    name, slots = ref_counter
    slots[3] = slots[4] = 1
    h3, h4 = (encode_handle(fields(ref_counter=name.encode(), ref_counter_offset=k)) for k in (3, 4))
    d = start_daemon(client_timeout=1.5)
    peer = RawPeer(d.endpoint)
    try:
        _, welcome = peer.request("hello", {"pid": os.getpid(), "name": "stalls"})
        assert snapshot(peer, str(d.root), h3, path="before/model.pt", msg_id=2).get("code") == "shared_memory"
        assert int(slots[3]) == 0
        deadline = time.monotonic() + 30
        while not any(c["id"] == welcome["client_id"] for c in daemon_status(d.endpoint)["clients_lost"]):
            assert time.monotonic() < deadline, "the silent client was never taken as gone"
            time.sleep(0.2)
        reply = snapshot(peer, str(d.root), h4, path="late/model.pt", msg_id=3)
        assert reply.get("code") == "unknown_client", reply
        assert int(slots[4]) == 0, "the refused snapshot's new handle kept its slot: its block stays parked"
        reply = snapshot(peer, str(d.root), h3, path="later/model.pt", msg_id=4)
        assert reply.get("code") == "unknown_client", reply
        assert int(slots[3]) == 0, f"a slot released once was released again: {int(slots[3])}"
        assert int(slots.count_nonzero()) == 0, "the daemon wrote a slot it was not asked about"
    finally:
        peer.close()
