"""CUDA IPC regions: a trainer's GPU storages, read by the daemon on its own CUDA stream.

The client describes each CUDA storage (``datastates.client.cuda``) as the IPC handle of
its caching-allocator block, the storage's offset and size in it, a slot in torch's
reference-counter file, the device's UUID and the snapshot's interprocess event, packed
into ``SourceDesc.handle``. ``open`` maps it as ``torch.multiprocessing`` does
(``rebuild_cuda_tensor``: ``UntypedStorage._new_shared_cuda``), on the local device with
that UUID, since CUDA_VISIBLE_DEVICES numbers devices differently in each process.

Lifetime rules:

- An opened region keeps the trainer's allocation alive. While the daemon's storage lives,
  its slot in the trainer's ref-counter file (a /dev/shm file named in the handle) is
  above zero, and the trainer's allocator parks a freed block in its "limbo" instead of
  reusing it. The trainer's GPU memory grows by every block the daemon still holds.
- So the daemon must drop a region once its snapshot is copied or its client is gone.
  The client's region cache already does: it keeps only the regions the latest snapshot
  of each file name uses, and ``release()`` clears all of them when the client goes.
  Dropping the last reference frees the storage, whose deleter decrements the slot.
- Each snapshot shares again and so names a fresh slot and event: its handle differs, the
  cache opens it anew, and the previous snapshot's region (dropped by the cache) releases
  the previous slot. torch caches the opened block per process, so the driver maps each
  block once while any region on it lives.
- A daemon that dies holding regions never decrements their slots: the trainer's blocks
  stay in limbo until the trainer exits.
- A trainer that exits first takes its device memory with it: torch requires a producer
  to outlive its consumers' references. So, unlike shared memory, a GPU snapshot survives
  a trainer crash only once it is copied (``wait()`` returned); the engine must fail the
  uncopied GPU snapshots of a client that is gone rather than copy from its regions.
- The handle's event must still exist when a copy opens it: the client keeps it until
  ``wait()`` returns, which is after every copy of the snapshot.

Importing this module never touches CUDA. The kind is always registered, so a daemon
without a CUDA device still checks a GPU snapshot's handles and refuses it with a clear
error instead of "unknown source kind".
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import re
import stat
import threading
from typing import Any

import msgpack
import torch

from datastates.protocol.descriptors import CUDA_IPC, SourceDesc
from datastates.protocol.errors import InvalidRequestError, SharedMemoryError
from datastates.protocol.paths import SHM_DIR

from .base import CopySource, Owner, Region, register_source

MAX_HANDLE = 8192
"""Characters of an encoded handle: a block handle is 64 bytes, an expandable segment's a few hundred."""
REF_COUNTER_SLOTS = 10000
"""torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 slots per ref-counter file; a larger offset writes out of bounds."""

_NAME_RE = re.compile(r"^/?[A-Za-z0-9_.-]{1,250}$")
_FIELDS: dict[str, type] = {
    "uuid": str, "block": bytes, "offset": int, "nbytes": int, "ref_counter": bytes,
    "ref_counter_offset": int, "share_event": bytes, "share_event_sync": bool, "event": bytes,
}


def decode_handle(handle: str) -> dict[str, Any]:
    """The checked fields of an encoded CUDA handle; the client is untrusted, so every field is checked."""
    if len(handle) > MAX_HANDLE:
        raise InvalidRequestError(f"a CUDA IPC handle of {len(handle)} characters is longer than {MAX_HANDLE}")
    try:
        fields = msgpack.unpackb(base64.urlsafe_b64decode(handle.encode("ascii")), raw=False)
    except (binascii.Error, ValueError, UnicodeEncodeError, msgpack.UnpackException) as exc:
        raise InvalidRequestError(f"bad CUDA IPC handle: {exc}") from None
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
        raise InvalidRequestError(f"a CUDA IPC handle holds exactly the fields {sorted(_FIELDS)}")
    for name, typ in _FIELDS.items():
        value = fields[name]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise InvalidRequestError(f"CUDA IPC handle: {name} must be {typ.__name__}")
    if fields["offset"] < 0 or fields["nbytes"] <= 0:
        raise InvalidRequestError("CUDA IPC handle: offset must be >= 0 and nbytes > 0")
    if not 0 <= fields["ref_counter_offset"] < REF_COUNTER_SLOTS:
        raise InvalidRequestError(f"CUDA IPC handle: ref_counter_offset outside 0..{REF_COUNTER_SLOTS - 1}")
    try:
        fields["ref_counter"] = fields["ref_counter"].decode("ascii")
    except UnicodeDecodeError:
        raise InvalidRequestError("CUDA IPC handle: ref_counter is not a shared-memory name") from None
    if not _NAME_RE.match(fields["ref_counter"]):
        raise InvalidRequestError(f"CUDA IPC handle: bad ref-counter name {fields['ref_counter'][:300]!r}")
    return fields


def _check_ref_counter(name: str) -> None:
    """The ref-counter file exists, is the daemon user's and holds every slot: torch writes to it when a region goes."""
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise SharedMemoryError(f"cannot open CUDA IPC ref-counter file {name!r}: {exc.strerror}", handle=name) from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size < 8 * REF_COUNTER_SLOTS:
        raise SharedMemoryError(f"ref-counter file {name!r} is not a full regular file owned by the daemon's user",
                                handle=name)


@functools.cache
def _devices_by_uuid() -> dict[str, int]:
    torch.cuda.init()
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def local_device(uuid: str) -> int:
    """This process's index of the device with ``uuid``."""
    devices = _devices_by_uuid()
    if uuid not in devices:
        raise SharedMemoryError(
            f"no CUDA device with UUID {uuid[:64]!r} is visible to the daemon (it sees {sorted(devices)}); "
            "run datastatesd with every GPU of the node visible", handle=uuid[:64]
        )
    return devices[uuid]


class CudaIpcRegion(Region):
    """One trainer storage, opened once; ``tensor`` is a flat uint8 CUDA view of exactly ``nbytes``."""

    in_trainer = True

    def __init__(self, fields: dict[str, Any]) -> None:
        _check_ref_counter(fields["ref_counter"])
        self.device = torch.device("cuda", local_device(fields["uuid"]))
        self.nbytes = fields["nbytes"]
        try:
            with torch.cuda.device(self.device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    self.device.index, fields["block"], self.nbytes, fields["offset"], fields["ref_counter"].encode(),
                    fields["ref_counter_offset"], fields["share_event"], fields["share_event_sync"],
                )
        except RuntimeError as exc:
            raise SharedMemoryError(f"cannot open a {self.nbytes}-byte CUDA IPC block on {self.device}: {exc}") from None
        self.tensor = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (self.nbytes,), (1,))
        self._event_handle = fields["event"]
        self._event: torch.cuda.Event | None = None
        self._event_lock = threading.Lock()

    def ready_event(self) -> torch.cuda.Event | None:
        """The snapshot's event, opened on first use (by whichever copy thread comes first); None if none was sent."""
        with self._event_lock:
            if self._event is None and self._event_handle:
                self._event = torch.cuda.Event.from_ipc_handle(self.device, self._event_handle)
            return self._event

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> torch.cuda.Event:
        return copy_to_host(self, src, dst, length, copy_stream(self.device))


_streams = threading.local()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling copy thread's own stream on ``device``: copy threads never wait on each other's copies."""
    streams = _streams.__dict__.setdefault("by_device", {})
    if device.index not in streams:
        streams[device.index] = torch.cuda.Stream(device)
    return streams[device.index]


def copy_to_host(region: CudaIpcRegion, src_offset: int, dst_tensor: torch.Tensor, length: int,
                 stream: torch.cuda.Stream) -> torch.cuda.Event:
    """Queue ``length`` bytes from ``src_offset`` into host ``dst_tensor`` on the daemon's ``stream``.

    The stream first waits for the snapshot's event, so the kernels the trainer queued
    before ``snapshot()`` are in the bytes. Returns an event the caller synchronizes on
    before it reads ``dst_tensor`` (checksums, writes). Into pinned memory (the pool's
    chunks, see daemon/pinning.py) the copy is asynchronous; into pageable memory the
    driver stages it and the call blocks, which is correct but slow.
    """
    if not 0 <= src_offset <= src_offset + length <= region.nbytes or length > dst_tensor.numel():
        raise ValueError(f"copy of {length} bytes at {src_offset} does not fit a {region.nbytes}-byte region "
                         f"and a {dst_tensor.numel()}-byte destination")
    ready = region.ready_event()
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        dst_tensor[:length].copy_(region.tensor[src_offset:src_offset + length], non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done


class CudaIpcSource(CopySource):
    kind = CUDA_IPC

    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        fields = decode_handle(desc.handle)
        if fields["nbytes"] != desc.nbytes:
            raise InvalidRequestError(f"CUDA IPC handle names {fields['nbytes']} bytes, the source {desc.nbytes}")
        if not torch.cuda.is_available():
            raise SharedMemoryError(
                "a GPU tensor was snapshotted, but datastatesd sees no CUDA device (a CPU-only torch, or no GPU "
                "visible to it): run the daemon with the node's GPUs visible, or move the state to CPU first",
                handle=fields["uuid"][:64],
            )
        return CudaIpcRegion(fields)


register_source(CudaIpcSource())
