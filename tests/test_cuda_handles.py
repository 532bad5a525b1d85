"""CUDA IPC handles from an untrusted client, on any machine: each bad field is a clear refusal, and service goes on.

The handles go to a real daemon over the wire, as a buggy or hostile client would send
them. No CUDA is needed: the daemon checks every field before it touches a device, and a
daemon without one refuses a well-formed GPU snapshot by saying so.
"""

from __future__ import annotations

import base64
import os
from typing import Any, Iterator

import msgpack
import pytest
import torch

from datastates.client.cuda import encode_handle
from datastates.protocol.descriptors import CUDA_IPC

from conftest import DaemonProc, RawPeer
from test_refusals import assert_still_serves

NBYTES = 4096


def fields(**change: Any) -> dict[str, Any]:
    """A well-formed description of a 4 KiB storage in a block of some GPU (its ref-counter file does not exist)."""
    good = {"uuid": "GPU-00000000-0000-0000-0000-000000000000", "block": b"\x01" * 64, "offset": 512, "nbytes": NBYTES,
            "ref_counter": b"/torch_999_1_0", "ref_counter_offset": 3, "share_event": b"\x02" * 64,
            "share_event_sync": True}
    return {**good, **change}


def snapshot(peer: RawPeer, root: str, handle: str, nbytes: int = NBYTES, msg_id: int = 2) -> dict:
    tensor = {"provider": "tensor", "name": "w", "meta": {
        "storage": 0, "dtype": "uint8", "shape": [nbytes], "stride": [1], "storage_offset": 0,
        "requires_grad": False, "parameter": False}}
    body = {"path": f"{root}/gpu/model.pt", "tag": "gpu", "root": 1,
            "sources": [{"kind": CUDA_IPC, "handle": handle, "nbytes": nbytes}],
            "entries": [tensor, {"provider": "pickle", "name": "<skeleton>", "meta": {"data": b"N."}}]}
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
    "a field missing": (raw({k: v for k, v in fields(event=b"").items() if k != "block"}), "holds exactly the fields"),
    "an extra field": (encode_handle(fields(pid=1), b""), "holds exactly the fields"),
    "offset a string": (encode_handle(fields(offset="512"), b""), "offset must be int"),
    "nbytes a bool": (encode_handle(fields(nbytes=True), b""), "nbytes must be int"),
    "negative offset": (encode_handle(fields(offset=-1), b""), "offset must be >= 0"),
    "zero bytes": (encode_handle(fields(nbytes=0), b""), "nbytes > 0"),
    "slot out of the file": (encode_handle(fields(ref_counter_offset=10000), b""), "ref_counter_offset outside"),
    "ref counter escaping /dev/shm": (encode_handle(fields(ref_counter=b"../../etc/passwd"), b""), "bad ref-counter name"),
    "ref counter not text": (encode_handle(fields(ref_counter=b"\xff\xfe"), b""), "not a shared-memory name"),
    "size disagreeing with the source": (encode_handle(fields(nbytes=NBYTES * 2), b""), "names 8192 bytes, the source 4096"),
    "too long": ("A" * 9000, "longer than 8192"),
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
    reply = snapshot(peer, str(shared_daemon.root), encode_handle(fields(), b"\x03" * 64))
    assert reply.get("code") == "shared_memory", reply
    expected = "cannot open CUDA IPC ref-counter file" if torch.cuda.is_available() else "sees no CUDA device"
    assert expected in reply["message"], reply["message"]
    assert not (shared_daemon.root / "gpu" / "model.pt").exists()
    assert_still_serves(shared_daemon)
