"""Describing a trainer's CUDA storages so the daemon can read them through CUDA IPC, without a copy.

As ``torch.multiprocessing`` does, ``storage._share_cuda_()`` names the caching-allocator
block that holds a storage (its IPC memory handle), where the storage starts in it and
how long it is, plus a slot in torch's reference-counter file set to 1: the trainer's
allocator parks the block (its "limbo") when the storage is freed while that slot is
above zero, and the daemon's mapping of the block brings it to zero when dropped.

Each call wraps the storage anew (a fresh slot and a fresh interprocess event that torch
keeps until the storage is freed), so ``SharedBlocks`` shares each storage once per client
and reuses its description for every later snapshot. Past 1,000 live events torch
synchronizes the *current stream* on every share instead of recording an event; every
share here runs with an idle stream of this module's own as the current one, so that
wait costs nothing and the trainer's queued work is never waited for, however many
storages a state holds. The daemon lets go of a storage it saw for the first time as soon
as its snapshot is copied (daemon/clients.py), so a tensor made for one state dict and
freed after ``wait()`` goes back to the allocator at once. When a storage the daemon kept
is freed, its handle is *retired*: the next snapshot tells the daemon, which drops its
mapping and zeroes the slot.

A storage in an expandable segment (``expandable_segments:True``, which can be switched on
at run time) has a handle the daemon never opens: such a storage is copied to host by the
client, alone, and its slot given back at once (with ``gpu_capture="ipc"``, it is an error).

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
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import msgpack
import torch

from datastates.protocol.cudart import own_stream
from datastates.protocol.descriptors import Fence
from datastates.protocol.errors import InvalidRequestError, SharedMemoryError

from .shm import SegmentPool

log = logging.getLogger(__name__)


@functools.cache
def device_uuid(index: int) -> str:
    """The UUID of the device ``index`` is in this process's numbering (stable across processes)."""
    return str(torch.cuda.get_device_properties(index).uuid)


EXPANDABLE = b"e"
"""The type byte of an expandable segment's block handle, which the daemon never opens (daemon/sources/cuda.py)."""
UNSHAREABLE_EXPANDABLE = "it lies in an expandable segment (expandable_segments:True): datastatesd never opens those"


@functools.cache
def _share_stream(index: int) -> torch.cuda.Stream:
    """A stream of device ``index`` of this module's alone (``own_stream``), idle but for a probe's upload (waited
    for at once): the current stream while torch shares a storage."""
    return own_stream(index)


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
    with torch.cuda.stream(_share_stream(storage.device.index)):  # torch records or waits on it, not the trainer's
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


def release_own_slot(desc: dict[str, Any]) -> None:
    """Give back the count ``_share_cuda_`` set for a handle no daemon will open, as torch's consumers do."""
    torch.UntypedStorage._release_ipc_counter_cuda(desc["ref_counter"], desc["ref_counter_offset"])


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

    def handle(self, storage: torch.UntypedStorage, required: bool = False) -> str:
        """``storage``'s handle: shared on first use; again only if its data moved (``resize_``, ``set_``).

        "" for a storage torch cannot share: memory not from its caching allocator (``from_blob``,
        DLPack, a pluggable allocator), or a tensor received from another process; and for one in
        an expandable segment, whose slot is given back here (remembered: it is shared once). The
        client copies such a storage to host itself, unless ``required`` (``gpu_capture="ipc"``,
        which promises CUDA IPC or an error): then it is SharedMemoryError.
        """
        key = storage._cdata
        with self._lock:
            known = self._by_storage.get(key)
        if (known is not None and known.storage() is storage and known.data_ptr == storage.data_ptr()
                and known.nbytes == storage.nbytes()):
            handle, why = known.handle, UNSHAREABLE_EXPANDABLE
        else:
            handle, why = self._share(key, storage)
        if required and not handle:
            raise SharedMemoryError(f"gpu_capture='ipc', but a {storage.nbytes()}-byte storage on "
                                    f"cuda:{storage.device.index} cannot go by CUDA IPC: {why}")
        return handle

    def _share(self, key: int, storage: torch.UntypedStorage) -> tuple[str, str]:
        """(handle, why it is "") of a storage not shared yet, or whose data moved."""
        try:
            desc = describe_cuda_storage(storage)
        except RuntimeError as exc:
            log.debug("a %d-byte CUDA storage cannot be shared: %s", storage.nbytes(), exc)
            return "", f"torch cannot share it ({exc})"
        if desc["block"][1:2] == EXPANDABLE:
            release_own_slot(desc)
            handle = ""
        else:
            handle = encode_handle(desc)
        entry = _Shared(weakref.ref(storage, lambda _ref: self._freed(key, handle)), storage.data_ptr(),
                        storage.nbytes(), handle)
        with self._lock:
            self.shares += 1
            old = self._by_storage.get(key)
            if old is not None and old.handle:
                self._retired.append(old.handle)
            self._by_storage[key] = entry
        return handle, UNSHAREABLE_EXPANDABLE

    def _freed(self, key: int, handle: str) -> None:
        with self._lock:
            known = self._by_storage.get(key)
            if known is not None and known.handle == handle:  # else ``handle`` already retired when replaced
                del self._by_storage[key]
                if handle:
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


REPROBE_S = 60.0
"""How long a device's route stands before the next snapshot on it probes again: a refusal may pass (the daemon
could not make its context then), and a daemon's context may break (its copies then fail until the probe sends
this client to host copies)."""

GPU_CAPTURE = ("auto", "ipc", "host")
"""``Client(gpu_capture=...)``: CUDA IPC where the daemon can open this client's handles, else the client
copies device to host itself; CUDA IPC or an error; always the client's own copy."""


class GpuRoute:
    """How this client's CUDA storages reach the daemon, decided per device and asked again every ``REPROBE_S``.

    CUDA IPC where the daemon can open this process's handles, which a probe of one small
    tensor tells before the first snapshot on that device. Where it cannot (a daemon that
    sees no GPU, or a different one; ``expandable_segments`` handles, opened with
    ``pidfd_getfd``, under Yama ``ptrace_scope`` 1 or across pid namespaces; GPUs in
    EXCLUSIVE_PROCESS mode), the client copies each storage to a /dev/shm segment it owns
    (``segments``) in ``snapshot()``, and the daemon reads that.
    """

    def __init__(self, mode: str, segments: SegmentPool, ask: Callable[[str, bytes], str]) -> None:
        if mode not in GPU_CAPTURE:
            raise InvalidRequestError(f"gpu_capture: {mode!r} is not one of {list(GPU_CAPTURE)}")
        self.mode = mode
        self.segments = segments
        self.blocks = SharedBlocks()
        self.paths: dict[int, str] = {}
        """Device index → "ipc", or "host: <why>"."""
        self._probed: dict[int, float] = {}
        self._ask = ask

    def ipc(self, device: int) -> bool:
        """Whether storages on ``device`` go by CUDA IPC (probing it on first use, and every ``REPROBE_S``);
        SharedMemoryError for ``gpu_capture="ipc"`` where the daemon cannot open them."""
        if device not in self.paths or (self.mode != "host"
                                        and time.monotonic() - self._probed[device] >= REPROBE_S):
            self._route(device)
        if self.mode == "ipc" and self.paths[device] != "ipc":
            raise SharedMemoryError(f"gpu_capture='ipc', but datastatesd cannot open this process's CUDA IPC handles "
                                    f"on cuda:{device}: {self.paths[device].removeprefix('host: ')}")
        return self.paths[device] == "ipc"

    def _route(self, device: int) -> None:
        refused = "gpu_capture='host'" if self.mode == "host" else self._probe(device)
        before, self.paths[device] = self.paths.get(device), f"host: {refused}" if refused else "ipc"
        self._probed[device] = time.monotonic()
        if self.mode != "auto" or self.paths[device] == before:
            return
        if refused:
            log.warning("datastatesd cannot open this process's CUDA IPC handles on cuda:%d (%s): its tensors "
                        "are copied to host memory by the trainer in snapshot()", device, refused)
        elif before is not None:
            log.warning("datastatesd opens this process's CUDA IPC handles on cuda:%d again: its tensors go by "
                        "CUDA IPC from now on", device)

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
    daemon answered). Written on the shares' stream (``_share_stream``), so the probe never waits for the
    trainer's queued work."""
    expect = os.urandom(64)
    side = _share_stream(device)
    with torch.cuda.stream(side):
        tensor = torch.frombuffer(bytearray(expect), dtype=torch.uint8).to(torch.device("cuda", device))
    side.synchronize()
    return encode_handle(describe_cuda_storage(tensor.untyped_storage())), expect, tensor
