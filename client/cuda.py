"""Describing a trainer's CUDA storages so the daemon can read them through CUDA IPC, without a copy.

As ``torch.multiprocessing`` does, ``storage._share_cuda_()`` names the caching-allocator
block that holds a storage (its IPC memory handle), where the storage starts in it and
how long it is, plus a slot in torch's reference-counter file: the daemon's open of the
block counts as a reference there, and the trainer's allocator keeps the block (in its
"limbo") while that count is above zero, even after the trainer frees the tensor. Each
call takes a fresh slot, so each snapshot shares again and the daemon opens again; the
CUDA driver and torch's IPC cache open the block itself only once per process.

The device travels as its UUID, not its index: CUDA_VISIBLE_DEVICES renumbers devices in
each rank, and the daemon sees all of them. The ordering fence is an interprocess event
recorded on the current stream at snapshot time: the daemon's copy stream waits on it, so
every kernel queued on that stream before ``snapshot()`` is in the bytes saved.

Importing this module never touches CUDA; every function here needs a CUDA device.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import msgpack
import torch

@functools.cache
def device_uuid(index: int) -> str:
    """The UUID of the device ``index`` is in this process's numbering (stable across processes)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def describe_cuda_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """What the daemon needs to open ``storage``: device UUID, block handle, offset, size, ref-counter slot.

    Every value is a str, int, bool or bytes, so the dict packs with msgpack as it is.
    A zero-byte storage has no block; describe it as an ``empty`` source instead.
    """
    if storage.device.type != "cuda":
        raise ValueError(f"not a CUDA storage: it is on {storage.device}")
    if storage.nbytes() == 0:
        raise ValueError("a zero-byte CUDA storage has no IPC block; use an 'empty' source")
    (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = storage._share_cuda_()
    return {
        "uuid": device_uuid(int(device)),
        "block": bytes(handle),
        "offset": int(offset_bytes),
        "nbytes": int(size_bytes),
        "ref_counter": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "share_event": bytes(event_handle),
        "share_event_sync": bool(event_sync_required),
    }


def snapshot_event(keepalive: list[Any]) -> bytes:
    """The IPC handle of an event recorded now on the current stream: the snapshot's fence.

    The event is appended to ``keepalive`` (the capture's, held until ``wait()`` returns):
    a handle the daemon opens after the trainer destroyed its event names nothing.
    """
    event = torch.cuda.Event(interprocess=True)
    event.record()
    keepalive.append(event)
    return bytes(event.ipc_handle())


def encode_handle(desc: dict[str, Any], event: bytes) -> str:
    """``desc`` and the snapshot's event as one ``SourceDesc.handle`` string (msgpack, base64url)."""
    return base64.urlsafe_b64encode(msgpack.packb({**desc, "event": event}, use_bin_type=True)).decode("ascii")
