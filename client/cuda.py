"""Describing a trainer's CUDA storages so the daemon can read them through CUDA IPC, without a copy.

As ``torch.multiprocessing`` does, ``storage._share_cuda_()`` names the caching-allocator
block that holds a storage (its IPC memory handle), where the storage starts in it and
how long it is, plus a slot in torch's reference-counter file set to 1: the trainer's
allocator parks the block (its "limbo") when the storage is freed while that slot is
above zero, and the daemon's mapping of the block brings it to zero when dropped.

Each call wraps the storage anew (a fresh slot and a fresh interprocess event that torch
keeps until the storage is freed; past 1,000 of them torch synchronizes the stream on
every share), so ``SharedBlocks`` shares each storage once per client and reuses its
description for every later snapshot. When the storage is freed, its handle is *retired*:
the next snapshot tells the daemon, which drops its mapping, which zeroes the slot.

The device travels as its UUID, not its index: CUDA_VISIBLE_DEVICES renumbers devices in
each rank, and the daemon sees all of them. The ordering fence is one interprocess event
per device, recorded on that device's current stream at snapshot time (``record_fences``):
the daemon copies a device's storages only once its event has completed.

Importing this module never touches CUDA; every function here needs a CUDA device.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgpack
import torch

from datastates.protocol.descriptors import Fence
from datastates.protocol.errors import InvalidRequestError, SharedMemoryError

from .shm import Staging

log = logging.getLogger(__name__)


@functools.cache
def device_uuid(index: int) -> str:
    """The UUID of the device ``index`` is in this process's numbering (stable across processes)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def describe_cuda_storage(storage: torch.UntypedStorage) -> dict[str, Any]:
    """What the daemon needs to open ``storage``: device UUID, block handle, offset, size, ref-counter slot.

    Every value is a str, int or bytes, so the dict packs with msgpack as it is. torch's
    per-share event is left out: the daemon orders its copies on the snapshot's fences.
    A zero-byte storage has no block; describe it as an ``empty`` source instead.
    """
    if storage.device.type != "cuda":
        raise ValueError(f"not a CUDA storage: it is on {storage.device}")
    if storage.nbytes() == 0:
        raise ValueError("a zero-byte CUDA storage has no IPC block; use an 'empty' source")
    (device, handle, size_bytes, offset_bytes, ref_counter_handle, ref_counter_offset, _event, _sync) = \
        storage._share_cuda_()
    return {
        "uuid": device_uuid(int(device)),
        "block": bytes(handle),
        "offset": int(offset_bytes),
        "nbytes": int(size_bytes),
        "ref_counter": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
    }


def encode_handle(desc: dict[str, Any]) -> str:
    """``desc`` as one ``SourceDesc.handle`` string (msgpack, base64url)."""
    return base64.urlsafe_b64encode(msgpack.packb(desc, use_bin_type=True)).decode("ascii")


def record_fences(devices: Iterable[int], keepalive: list[Any]) -> list[Fence]:
    """One interprocess event per device, recorded now on its current stream: the snapshot's fences.

    Only work queued on those streams before this call is ordered: a tensor written on a side
    stream (ZeRO's or FSDP's prefetch streams) must be joined to the current stream first
    (``torch.cuda.current_stream().wait_stream(side)``), as before any other use of it. The
    events go to ``keepalive`` (the capture's, held until the daemon has copied): a handle
    whose event the trainer destroyed names nothing.
    """
    fences = []
    for index in sorted(set(devices)):
        with torch.cuda.device(index):
            event = torch.cuda.Event(interprocess=True)
            event.record()
        keepalive.append(event)
        fences.append(Fence(uuid=device_uuid(index), event=bytes(event.ipc_handle())))
    return fences


@dataclass
class _Shared:
    storage: weakref.ref
    data_ptr: int
    nbytes: int
    handle: str


class SharedBlocks:
    """Each CUDA storage shared once per client; the handles of those freed since, for the next snapshot."""

    def __init__(self) -> None:
        self._by_storage: dict[int, _Shared] = {}
        self._retired: list[str] = []
        self._lock = threading.RLock()  # weakref callbacks run on whichever thread frees a storage, even inside handle()
        self.shares = 0
        """``_share_cuda_`` calls so far: one per storage lifetime, however many snapshots name it."""

    def handle(self, storage: torch.UntypedStorage) -> str:
        """``storage``'s handle: shared on first use; again only if its data moved (``resize_``, ``set_``).

        "" for a storage torch cannot share: memory not from its caching allocator (``from_blob``,
        DLPack, a pluggable allocator), or a tensor received from another process. The client
        copies such a storage to host itself.
        """
        key = storage._cdata
        with self._lock:
            known = self._by_storage.get(key)
        if (known is not None and known.storage() is storage and known.data_ptr == storage.data_ptr()
                and known.nbytes == storage.nbytes()):
            return known.handle
        try:
            handle = encode_handle(describe_cuda_storage(storage))
        except RuntimeError as exc:
            log.debug("a %d-byte CUDA storage cannot be shared (%s): copied to host instead", storage.nbytes(), exc)
            return ""
        entry = _Shared(weakref.ref(storage, lambda _ref: self._freed(key, handle)), storage.data_ptr(),
                        storage.nbytes(), handle)
        with self._lock:
            self.shares += 1
            old = self._by_storage.get(key)
            if old is not None:
                self._retired.append(old.handle)
            self._by_storage[key] = entry
        return handle

    def _freed(self, key: int, handle: str) -> None:
        with self._lock:
            known = self._by_storage.get(key)
            if known is not None and known.handle == handle:  # else ``handle`` already retired when replaced
                del self._by_storage[key]
                self._retired.append(handle)

    def take_retired(self) -> list[str]:
        """The handles retired since the last call: the daemon may drop its mappings of them."""
        with self._lock:
            retired, self._retired = self._retired, []
        return retired

    def untake(self, retired: list[str]) -> None:
        """Handles taken for a message that could not be sent: for the next one."""
        with self._lock:
            self._retired[:0] = retired


GPU_CAPTURE = ("auto", "ipc", "host")
"""``Client(gpu_capture=...)``: CUDA IPC where the daemon can open this client's handles, else the client
copies device to host itself; CUDA IPC or an error; always the client's own copy."""


class GpuRoute:
    """How this client's CUDA storages reach the daemon, decided once per device.

    CUDA IPC where the daemon can open this process's handles, which a probe of one small
    tensor tells before the first snapshot on that device. Where it cannot (a daemon that
    sees no GPU, or a different one; ``expandable_segments`` handles, opened with
    ``pidfd_getfd``, under Yama ``ptrace_scope`` 1 or across pid namespaces; GPUs in
    EXCLUSIVE_PROCESS mode), the client copies each storage to a /dev/shm segment it owns
    (``staging``) in ``snapshot()``, and the daemon reads that.
    """

    def __init__(self, mode: str, staging: Staging, ask: Callable[[str, bytes], str]) -> None:
        if mode not in GPU_CAPTURE:
            raise InvalidRequestError(f"gpu_capture: {mode!r} is not one of {list(GPU_CAPTURE)}")
        self.mode = mode
        self.staging = staging
        self.blocks = SharedBlocks()
        self.paths: dict[int, str] = {}
        """Device index → "ipc", or "host: <why>"."""
        self._ask = ask

    def ipc(self, device: int) -> bool:
        """Whether storages on ``device`` go by CUDA IPC (probing it on first use); SharedMemoryError for
        ``gpu_capture="ipc"`` where the daemon cannot open them."""
        if device not in self.paths:
            refused = "gpu_capture='host'" if self.mode == "host" else self._probe(device)
            self.paths[device] = f"host: {refused}" if refused else "ipc"
            if refused and self.mode == "auto":
                log.warning("datastatesd cannot open this process's CUDA IPC handles on cuda:%d (%s): its tensors "
                            "are copied to host memory by the trainer in snapshot()", device, refused)
        if self.mode == "ipc" and self.paths[device] != "ipc":
            raise SharedMemoryError(f"gpu_capture='ipc', but datastatesd cannot open this process's CUDA IPC handles "
                                    f"on cuda:{device}: {self.paths[device].removeprefix('host: ')}")
        return self.paths[device] == "ipc"

    def _probe(self, device: int) -> str:
        try:
            handle, expect, tensor = probe(device)
        except RuntimeError as exc:  # this process cannot share its memory at all
            return f"cannot share this process's CUDA memory: {exc}"
        refused = self._ask(handle, expect)
        del tensor  # after the answer: the daemon read it through the handle
        return refused


def probe(device: int) -> tuple[str, bytes, torch.Tensor]:
    """A small tensor on ``device`` with random bytes: its handle, the bytes, and the tensor (keep it until the
    daemon answered). Written on a stream of its own, so the probe never waits for the trainer's queued work."""
    expect = os.urandom(64)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        tensor = torch.frombuffer(bytearray(expect), dtype=torch.uint8).to(torch.device("cuda", device))
    side.synchronize()
    return encode_handle(describe_cuda_storage(tensor.untyped_storage())), expect, tensor
