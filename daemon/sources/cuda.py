"""CUDA IPC regions: a trainer's GPU storages, read by the daemon on its own CUDA streams.

The client describes each CUDA storage once (``datastates.client.cuda``): the IPC handle
of its caching-allocator block, the storage's offset and size in it, a slot in torch's
reference-counter file and the device's UUID, packed into ``SourceDesc.handle``. ``open``
maps it as ``torch.multiprocessing`` does (``UntypedStorage._new_shared_cuda``), on the
local device with that UUID, since CUDA_VISIBLE_DEVICES numbers devices differently in
each process. Every field comes from an untrusted client and is checked first; after the
open, the storage's range is checked against the allocation the driver actually mapped,
since a copy past it would raise ``cudaErrorIllegalAddress`` and poison the daemon's CUDA
context for every rank on that GPU.

Ordering. The snapshot's fences (one interprocess event per device, recorded by the
trainer at ``snapshot()``) are polled with ``query()`` on a thread of their own
(``Fences.wait``), under a deadline and the trainer's liveness, before the snapshot takes
any pool chunk or copy thread; the daemon's streams never wait on a
trainer's event, which a killed trainer can leave pending for ever (pytorch#15974). torch's
own per-share event is never used (``event_sync_required`` False): it would queue a wait
on the NULL stream and leak an event per open.

Reference counts. torch sets a storage's slot to 1 when the client shares it, and parks
the trainer's block when the storage is freed while its slot is above zero. The slot is
read as unsigned: one decrement too many parks the block for ever, one too few too. So
every slot write is the daemon's own, one at a time (``adjust_ref_counter``), and torch's
deleter never writes one: the daemon opens each block naming a counter file that cannot
exist (``UNTRACKED``), which torch's deleter skips. Each open region holds one count on
its slot, the share's own or one added before the open, and gives it back the moment the
region goes (``CudaIpcRegion.__del__``), before its mapping is closed on the releasing
thread. Which regions a client keeps, and for how long, is ``ClientRecord``'s
(daemon/clients.py): a handle seen once is let go as soon as its snapshot is copied. A
handle the daemon never opens (the snapshot was refused or skipped first) is decremented
at once (``release_unopened``); a decrement never takes a slot below zero.

CUDA objects are dropped on one thread of their own (``_Releaser``), never on the event
loop: torch's deleter synchronizes the dropping thread's current stream. Every open,
fence and copy first asks ``gpus`` (daemon/gpus.py) for a sound context on its GPU.

- A daemon that dies holding regions never decrements their slots: the trainer's freed
  blocks stay parked until the trainer exits.
- A trainer that exits first takes its device memory with it, so a GPU snapshot survives a
  trainer crash only once it is copied (``wait()`` returned); the engine fails the uncopied
  GPU snapshots of a client that is gone rather than copy from its regions.

Importing this module never touches CUDA. The kind is always registered, so a daemon
without a CUDA device still checks a GPU snapshot's handles and refuses it with a clear
error instead of "unknown source kind".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
import queue
import re
import stat
import struct
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable, Sequence

import msgpack
import torch

from datastates.protocol.descriptors import CUDA_IPC, Fence, SourceDesc
from datastates.protocol.errors import DatastatesError, InvalidRequestError, SharedMemoryError, SnapshotFailedError
from datastates.protocol.paths import SHM_DIR

from datastates.protocol.cudart import own_stream

from ..gpus import allocation_range, gpus, local_device
from .base import CopySource, Owner, Region, register_source

MAX_HANDLE = 8192
"""Characters of an encoded handle (its block handle is 66 bytes)."""
IPC_HANDLE = 64
"""CUDA_IPC_HANDLE_SIZE: a cudaIpcMemHandle_t or cudaIpcEventHandle_t. torch reads that many bytes from any
handle it is given, so a shorter one would be read past its end."""
REF_COUNTER_SLOTS = 10000
"""torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 slots per ref-counter file; a larger offset writes out of bounds."""

_NAME_RE = re.compile(r"^/?[A-Za-z0-9_.-]{1,250}$")
_FIELDS: dict[str, type] = {
    "uuid": str, "block": bytes, "offset": int, "nbytes": int, "ref_counter": bytes, "ref_counter_offset": int,
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
    _check_block(fields["block"])
    if not 0 <= fields["ref_counter_offset"] < REF_COUNTER_SLOTS:
        raise InvalidRequestError(f"CUDA IPC handle: ref_counter_offset outside 0..{REF_COUNTER_SLOTS - 1}")
    try:
        fields["ref_counter"] = fields["ref_counter"].decode("ascii")
    except UnicodeDecodeError:
        raise InvalidRequestError("CUDA IPC handle: ref_counter is not a shared-memory name") from None
    if not _NAME_RE.match(fields["ref_counter"]):
        raise InvalidRequestError(f"CUDA IPC handle: bad ref-counter name {fields['ref_counter'][:300]!r}")
    return fields


def _check_block(block: bytes) -> None:
    """torch's shareable handle: a version byte, a type byte, then a cudaIpcMemHandle_t ('c') or an
    expandable segment ('e', never opened: see ``open_cuda``). torch reads a 'c' handle's 64 bytes
    whatever its length."""
    kind = block[1:2]
    if kind not in (b"c", EXPANDABLE):
        raise InvalidRequestError(f"CUDA IPC handle: unknown block handle type {kind!r}")
    if kind == b"c" and len(block) != 2 + IPC_HANDLE:
        raise InvalidRequestError(f"CUDA IPC handle: a cudaMalloc block handle is {2 + IPC_HANDLE} bytes, "
                                  f"not {len(block)}")


EXPANDABLE = b"e"
"""The block handle type of an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).

Never opened: torch opens one with ``pidfd_getfd`` on a pid the handle itself names (a client
could make the daemon take descriptors from any process of its user), divides by a segment
size it never checks, and reserves 1.125 × the GPU's memory of address space per open. Such a
trainer learns it from its probe and copies its GPU tensors to host itself."""


REF_COUNTER_HEADER = 64
"""torch's RefcountedMapAllocator keeps its own reference count in front of the data (``map_alloc_alignment``):
slot ``k`` of a ref-counter file is the int64 at byte ``64 + 8k``."""
REF_COUNTER_BYTES = REF_COUNTER_HEADER + 8 * REF_COUNTER_SLOTS


def _ref_counter_path(name: str) -> str:
    return os.path.join(SHM_DIR, name.lstrip("/"))


def check_ref_counter_name(name: str, pid: int) -> None:
    """A ref-counter file is named by torch after the process that shares (``/torch_<pid>_<n>_<n>``): a client
    may name only its own, never another rank's counters or segments."""
    if not re.fullmatch(rf"/?torch_{pid}_\d+_\d+", name):
        raise InvalidRequestError(f"CUDA IPC handle: {name[:300]!r} is not a ref-counter file of the client's own "
                                  f"process {pid}")


def _full_counter_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_size >= REF_COUNTER_BYTES


def _check_ref_counter(name: str) -> None:
    """The ref-counter file exists, is the daemon user's and holds every slot: torch writes to it when a region goes."""
    try:
        st = os.stat(_ref_counter_path(name), follow_symlinks=False)
    except OSError as exc:
        raise SharedMemoryError(f"cannot open CUDA IPC ref-counter file {name!r}: {exc.strerror}", handle=name) from None
    if not _full_counter_file(st):
        raise SharedMemoryError(f"ref-counter file {name!r} is not a full regular file owned by the daemon's user",
                                handle=name)


UNTRACKED = b"/datastates/untracked"
"""The ref-counter name the daemon gives torch when it opens a block: no shared-memory name may hold a
slash after the first, so torch's deleter finds no file there and writes nothing (it skips a missing one)."""

_counter_lock = threading.Lock()
_writing = threading.local()


def adjust_ref_counter(name: str, offset: int, delta: int) -> None:
    """Add ``delta`` to slot ``offset`` of ref-counter file ``name``, never below zero; nothing if the file is
    gone (its trainer exited) or not one the daemon may touch.

    One write at a time, each a whole read-modify-write. A call made while this thread is
    writing already (a region's finalizer, run by the collector mid-write) is applied by
    that write's loop before it returns, not nested inside it.
    """
    queued = getattr(_writing, "queue", None)
    if queued is not None:
        queued.append((name, offset, delta))
        return
    _writing.queue = queued = [(name, offset, delta)]
    try:
        with _counter_lock:
            while queued:
                _write_slot(*queued.pop(0))
    finally:
        _writing.queue = None


def _write_slot(name: str, offset: int, delta: int) -> None:
    try:
        fd = os.open(_ref_counter_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if not _full_counter_file(os.fstat(fd)):
            return
        at = REF_COUNTER_HEADER + 8 * offset
        (value,) = struct.unpack("<q", os.pread(fd, 8, at))
        os.pwrite(fd, struct.pack("<q", max(value + delta, 0) if delta < 0 else value + delta), at)
    finally:
        os.close(fd)


def release_unopened(fields: dict[str, Any], pid: int) -> None:
    """Give back the count a handle of client process ``pid`` holds for the daemon (the share's, or one added
    for an open that failed): its trainer frees the block when it frees the storage. A slot in any other
    process's file is left alone."""
    try:
        check_ref_counter_name(fields["ref_counter"], pid)
    except InvalidRequestError:
        return
    adjust_ref_counter(fields["ref_counter"], fields["ref_counter_offset"], -1)


def _no_cuda(uuid: str) -> SharedMemoryError:
    return SharedMemoryError(
        "a GPU tensor was snapshotted, but datastatesd sees no CUDA device (a CPU-only torch, or no GPU "
        "visible to it): run the daemon with the node's GPUs visible, or use Client(gpu_capture='host')",
        handle=uuid[:64],
    )


class _Releaser:
    """One thread that drops CUDA objects (opened storages, events), each under its own device: torch's deleter
    of an opened storage synchronizes the current device's NULL stream, which must never be the event loop's,
    a copy thread's, or another GPU's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.RLock()  # drop() runs from finalizers, which the collector may run inside drop()

    def drop(self, device: int, obj: Any) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ds-cuda-release", daemon=True)
                self._thread.start()
        self._queue.put((device, obj))

    def flush(self, timeout: float) -> None:
        """Wait until everything dropped so far is gone (the daemon's exit: the trainers' blocks unmapped)."""
        with self._lock:
            if self._thread is None:
                return
        done = threading.Event()
        self._queue.put((-1, done))
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            device, obj = self._queue.get()
            if isinstance(obj, threading.Event):
                obj.set()
                continue
            with torch.cuda.device(device):
                del obj


_releaser = _Releaser()


def flush_releases(timeout: float) -> None:
    """Wait until every CUDA object dropped so far is gone: at exit, so every mapping of a trainer's block is
    closed (the slots went back as the regions were dropped)."""
    _releaser.flush(timeout)


class CudaIpcRegion(Region):
    """One trainer storage as the daemon opened it, for one snapshot or kept by its client (daemon/clients.py);
    ``tensor`` is a flat uint8 CUDA view of exactly ``nbytes``. It holds one count on the storage's slot.

    Made only by ``open_cuda``, which gives that count back whenever it raises.
    """

    in_trainer = True
    fenced = True

    def __init__(self, device: torch.device, tensor: torch.Tensor, slot: tuple[str, int]) -> None:
        self.device = device
        self.nbytes = tensor.numel()
        self.tensor = tensor
        self.slot = slot
        """(ref-counter file, offset): the trainer's slot this region holds one count on."""

    def __del__(self) -> None:
        tensor = self.__dict__.pop("tensor", None)
        if tensor is not None:  # nothing copies from it any more: the count goes back now, the mapping after
            adjust_ref_counter(*self.slot, -1)
            _releaser.drop(self.device.index, tensor)

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> CudaCopy:
        return copy_to_host(self, src, dst, length, copy_stream(self.device))


class CudaCopy:
    """A device-to-host copy in flight (``base.Pending``). A CUDA fault in its DMA surfaces only at
    ``synchronize``, on whichever thread waits (the copier's ``_wait_all``, a probe): it is told to ``gpus``
    there and then, so a sticky error marks the GPU broken before another copy is queued on it."""

    def __init__(self, event: torch.cuda.Event, device: int) -> None:
        self.event = event
        self.device = device

    def synchronize(self) -> None:
        try:
            self.event.synchronize()
        except RuntimeError as exc:
            gpus.check(self.device, exc)
            raise


_streams = threading.local()


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's own stream on ``device``, made once and not from torch's pool (``own_stream``):
    a thread's copies never queue behind another thread's, as two threads handed one pool stream would."""
    streams = _streams.__dict__.setdefault("by_device", {})
    if device.index not in streams:
        streams[device.index] = own_stream(device.index)
    return streams[device.index]


def copy_to_host(region: CudaIpcRegion, src_offset: int, dst_tensor: torch.Tensor, length: int,
                 stream: torch.cuda.Stream) -> CudaCopy:
    """Queue ``length`` bytes from ``src_offset`` into host ``dst_tensor`` on the daemon's ``stream``.

    The engine has waited for the snapshot's fences (``Fences.wait``). Returns the copy, which
    the caller synchronizes on before it reads ``dst_tensor`` or gives its chunk back. Into
    pinned memory (the pool's chunks, see daemon/pagelock.py) the copy is asynchronous; into
    pageable memory the driver stages it and the call blocks, which is correct but slow.
    """
    if not 0 <= src_offset <= src_offset + length <= region.nbytes or length > dst_tensor.numel():
        raise ValueError(f"copy of {length} bytes at {src_offset} does not fit a {region.nbytes}-byte region "
                         f"and a {dst_tensor.numel()}-byte destination")
    gpus.ready(region.device.index)
    try:
        with torch.cuda.stream(stream):
            dst_tensor[:length].copy_(region.tensor[src_offset:src_offset + length], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
    except RuntimeError as exc:
        gpus.check(region.device.index, exc)
        raise
    return CudaCopy(done, region.device.index)


def check_fences(fences: Sequence[Fence]) -> list[Fence]:
    """The snapshot's fences, checked: exact event handles, one per device, each device one the daemon sees."""
    if len({f.uuid for f in fences}) != len(fences):
        raise InvalidRequestError("a snapshot names one fence per device; this one names a device twice")
    for fence in fences:
        if len(fence.event) != IPC_HANDLE:
            raise InvalidRequestError(f"a fence's event handle is {IPC_HANDLE} bytes, not {len(fence.event)}")
        if not torch.cuda.is_available():
            raise _no_cuda(fence.uuid)
        gpus.ready(local_device(fence.uuid))
    return list(fences)


POLL_S = (0.0002, 0.005)
"""How often the daemon asks whether a snapshot's fences have completed: at first, and at most."""


class Fences:
    """A snapshot's fences, waited for before any of its pieces takes a pool chunk or a copy thread.

    Polled with ``query()`` on a thread of their own (``executor``), never on the event loop,
    and never by making a stream wait: a fence the trainer never completes (killed
    mid-kernel, hung) fails this snapshot once ``stopped`` names a reason (its trainer gave
    up or is gone) or after ``timeout`` seconds. Meanwhile every copy thread and every chunk
    serves the other snapshots, so a trainer's long kernel stalls no other rank.
    """

    def __init__(self, fences: Sequence[Fence], timeout: float) -> None:
        self._fences = list(fences)
        self._timeout = timeout
        self._events: list[torch.cuda.Event] = []

    async def wait(self, stopped: Callable[[], str | None], executor: Executor) -> None:
        if not self._fences:
            return
        loop = asyncio.get_running_loop()
        deadline, pause = time.monotonic() + self._timeout, POLL_S[0]
        while not await loop.run_in_executor(executor, self._completed):
            why = stopped()
            if why:
                raise SnapshotFailedError(f"gave up waiting for the trainer's GPU work queued before snapshot(): {why}")
            if time.monotonic() > deadline:
                raise SnapshotFailedError(f"the trainer's GPU work queued before snapshot() did not finish within "
                                          f"fence_timeout ({self._timeout:.0f} s)")
            await asyncio.sleep(pause)
            pause = min(pause * 2, POLL_S[1])

    def _completed(self) -> bool:
        devices = [local_device(f.uuid) for f in self._fences]
        try:
            for index in devices:
                gpus.ready(index)
            if not self._events:
                self._events = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), f.event)
                                for index, f in zip(devices, self._fences)]
            return all(event.query() for event in self._events)
        except SharedMemoryError as exc:
            raise SnapshotFailedError(f"the trainer's fence cannot be waited for: {exc.message}") from None
        except RuntimeError as exc:  # a bad handle, a trainer killed mid-kernel, or a broken context
            for index in devices:
                gpus.check(index, exc)
            raise SnapshotFailedError(f"the trainer's fence cannot be waited for: {exc}") from None

    def __del__(self) -> None:
        for event in self.__dict__.pop("_events", None) or ():
            _releaser.drop(event.device.index, event)


def open_cuda(fields: dict[str, Any], nbytes: int, pid: int) -> CudaIpcRegion:
    """Open a decoded handle of client process ``pid``, whose source declares ``nbytes``; the region takes the
    count the slot holds for this open (the share's, or one the caller added). Whenever this raises, that
    count has been given back (``release_unopened``) if the slot is one of ``pid``'s."""
    check_ref_counter_name(fields["ref_counter"], pid)
    if fields["nbytes"] != nbytes:
        release_unopened(fields, pid)
        raise InvalidRequestError(f"CUDA IPC handle names {fields['nbytes']} bytes, the source {nbytes}")
    index: int | None = None
    try:
        if fields["block"][1:2] == EXPANDABLE:
            raise SharedMemoryError("datastatesd does not open CUDA IPC handles of expandable segments "
                                    "(expandable_segments:True): the trainer copies such tensors to host itself")
        if not torch.cuda.is_available():
            raise _no_cuda(fields["uuid"])
        _check_ref_counter(fields["ref_counter"])
        index = local_device(fields["uuid"])
        device = torch.device("cuda", index)
        gpus.ready(index)
        with torch.cuda.device(device):
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index, fields["block"], fields["nbytes"], fields["offset"], UNTRACKED, 0,
                bytes(IPC_HANDLE), False,
            )
            tensor = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (fields["nbytes"],), (1,))
        del storage
    except SharedMemoryError:
        release_unopened(fields, pid)
        raise
    except RuntimeError as exc:
        release_unopened(fields, pid)
        if index is not None:
            gpus.check(index, exc)
        raise SharedMemoryError(f"cannot open a {fields['nbytes']}-byte CUDA IPC block on the GPU "
                                f"{fields['uuid'][:64]}: {exc}") from None
    region = CudaIpcRegion(device, tensor, (fields["ref_counter"], fields["ref_counter_offset"]))
    del tensor
    failure: DatastatesError | None = None
    try:
        start = region.tensor.data_ptr() - fields["offset"]
        base, size = allocation_range(index, start)
        if not base <= start or start + fields["offset"] + fields["nbytes"] > base + size:
            failure = InvalidRequestError(f"CUDA IPC handle: {fields['nbytes']} bytes at offset {fields['offset']} "
                                          f"lie outside the {base + size - start}-byte allocation its block maps")
    except (RuntimeError, OSError) as exc:
        failure = SharedMemoryError(f"cannot check the CUDA IPC block opened on {device}: {exc}")
    if failure is not None:
        del region  # its count goes back here and now, before this raises
        raise failure
    return region


PROBE_BYTES = 4096
"""The most bytes a probe's tensor may have: the daemon copies all of them to host memory."""


def probe(handle: str, expect: bytes, pid: int) -> str:
    """Open client ``pid``'s ``handle`` and read it back as a copy would: "" if that gave ``expect``, else why not."""
    try:
        fields = decode_handle(handle)
        if len(expect) > PROBE_BYTES:
            release_unopened(fields, pid)
            raise InvalidRequestError(f"a probe is a tensor of at most {PROBE_BYTES} bytes, sent with its bytes")
        region = open_cuda(fields, len(expect), pid)
        host = torch.empty(region.nbytes, dtype=torch.uint8)
        copy_to_host(region, 0, host, region.nbytes, copy_stream(region.device)).synchronize()  # faults: to gpus
        if host.numpy().tobytes() != expect:
            return "the daemon read other bytes than the trainer holds through its CUDA IPC handle"
        return ""
    except Exception as exc:  # any failure is an answer: the client then copies to host itself
        return exc.message if isinstance(exc, DatastatesError) else f"{type(exc).__name__}: {exc}"


class CudaIpcSource(CopySource):
    kind = CUDA_IPC

    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        return open_cuda(decode_handle(desc.handle), desc.nbytes, owner.pid)


register_source(CudaIpcSource())
