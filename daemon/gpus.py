"""The daemon's CUDA context on each GPU it sees: made when it starts, kept for its lifetime, and watched.

A context takes a few hundred MB of its GPU. Made at a trainer's first snapshot, it would
come out of memory the trainer's caching allocator already holds: it fails (and that
trainer copies to host for good) or it succeeds and the trainer's next allocation runs out.
So ``hold`` makes and retains every GPU's primary context when the daemon starts, before
its trainers allocate; a GPU that refused one then (full, or EXCLUSIVE_PROCESS held by a
trainer) is asked again at each later probe or open on it. A GPU whose compute mode is not
the default gets no context from the daemon at all: in EXCLUSIVE_PROCESS mode one would
lock its trainers out; their probes send them to host copies.

A sticky CUDA error (a fault in a copy, say from memory a killed trainer took with it)
breaks a process's context on that GPU for good: every later call there fails. After any
CUDA error, ``check`` asks the context a question that cannot fail on its own; if that
fails too, the GPU is *broken*: every open, probe, fence and copy on it is refused with
that reason, so its trainers' probes move them to host copies, and ``status`` says it.
Only a new process gets a new context: restart datastatesd to use that GPU again (the daemon does
not restart itself; docs/gpu.md says why, and how under each deployment).

Importing this module never touches CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from typing import Any

import torch

from datastates.protocol.errors import SharedMemoryError

log = logging.getLogger(__name__)

HELD, REFUSED, BROKEN = "held", "refused", "broken"


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit.argtypes = [ctypes.c_uint]
    lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
    lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
    lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.c_uint64]
    return lib


def _cu(err: int, what: str) -> None:
    if err != 0:
        raise RuntimeError(f"{what} failed (CUresult {err})")


COMPUTE_MODE = 20
"""CU_DEVICE_ATTRIBUTE_COMPUTE_MODE."""
COMPUTE_MODES = {1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}


def exclusive_mode(device: int) -> str:
    """"" where GPU ``device`` is in the default compute mode (any number of contexts), else its mode: a context
    of the daemon's there would keep the trainers out."""
    lib = _driver()
    _cu(lib.cuInit(0), "cuInit")
    dev, mode = ctypes.c_int(), ctypes.c_int()
    _cu(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _cu(lib.cuDeviceGetAttribute(ctypes.byref(mode), COMPUTE_MODE, dev), "cuDeviceGetAttribute")
    return COMPUTE_MODES.get(mode.value, "")


def _retain(device: int) -> tuple[ctypes.c_int, ctypes.c_void_p]:
    """``device``'s primary context, made if need be and retained: the one torch's runtime calls use."""
    lib = _driver()
    _cu(lib.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    _cu(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    _cu(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    return dev, ctx


def allocation_range(device: int, address: int) -> tuple[int, int]:
    """The base and size of the allocation that holds ``address`` on ``device`` (``cuMemGetAddressRange``).

    The device's primary context is made current explicitly for the call: a thread whose
    open hit torch's cache of opened blocks has made no CUDA call, and may have none current.
    """
    lib = _driver()
    dev, ctx = _retain(device)
    try:
        _cu(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        try:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _cu(lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), address), "cuMemGetAddressRange")
            return base.value, size.value
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        lib.cuDevicePrimaryCtxRelease_v2(dev)


@functools.cache
def devices_by_uuid() -> dict[str, int]:
    torch.cuda.init()
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


def local_device(uuid: str) -> int:
    """This process's index of the device with ``uuid``."""
    devices = devices_by_uuid()
    if uuid not in devices:
        raise SharedMemoryError(
            f"no CUDA device with UUID {uuid[:64]!r} is visible to the daemon (it sees {sorted(devices)}); "
            "run datastatesd with every GPU of the node visible", handle=uuid[:64]
        )
    return devices[uuid]


class Gpus:
    """Each GPU's context: ``held``, ``refused`` (asked again on next use) or ``broken`` (for good), with why."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: dict[int, tuple[str, str]] = {}

    def hold(self) -> None:
        """Make and keep every visible GPU's context: at daemon start, on a thread of its own (a few hundred ms each)."""
        try:
            if not torch.cuda.is_available():
                return
            for index in range(torch.cuda.device_count()):
                self._make(index)
        except Exception:  # noqa: BLE001 - a GPU missing its context is asked again at its first use
            log.exception("making the daemon's CUDA contexts failed")

    def ready(self, index: int) -> None:
        """Raise SharedMemoryError, with why, unless the daemon has a sound context on GPU ``index``."""
        state, why = self._state.get(index, (REFUSED, "not made yet"))
        if state == REFUSED:
            state, why = self._make(index)
        if state != HELD:
            raise SharedMemoryError(self._say(index, state, why), handle=self._uuid(index))

    def check(self, index: int, exc: BaseException) -> None:
        """After CUDA error ``exc`` on GPU ``index``: mark it broken if the context itself is (a sticky error)."""
        try:
            with torch.cuda.device(index):
                torch.cuda.current_stream(index).query()  # an idle question: it fails only for a broken context
        except RuntimeError as sticky:
            with self._lock:
                if self._state.get(index, ("", ""))[0] == BROKEN:
                    return
                self._state[index] = (BROKEN, f"{sticky} (after: {exc})")
            log.error("%s", self._say(index, BROKEN, str(sticky)))

    def broken(self, index: int) -> bool:
        return self._state.get(index, ("", ""))[0] == BROKEN

    def not_held(self, index: int) -> str:
        """"" where the daemon holds a sound context on GPU ``index``, else why not. A GPU not asked yet (``hold``
        is still on its way) is asked now; one refused is not asked again here (page-locking under it would make
        a context on a full GPU, or lock out an exclusive one's trainers)."""
        state, why = self._make(index, retry=False)
        return "" if state == HELD else f"{state}: {why}"

    def status(self) -> list[dict[str, Any]]:
        """For ``status``: each GPU's context, and the device memory the daemon's own allocator holds there."""
        return [{"index": i, "uuid": self._uuid(i), "context": state if state == HELD else f"{state}: {why}",
                 "allocator_reserved": torch.cuda.memory_reserved(i) if state == HELD else 0}
                for i, (state, why) in sorted(self._state.items())]

    def _make(self, index: int, retry: bool = True) -> tuple[str, str]:
        with self._lock:
            state = self._state.get(index)
            if state is not None and (state[0] != REFUSED or not retry):
                return state
            try:
                mode = exclusive_mode(index)
                if mode:
                    raise RuntimeError(f"its compute mode is {mode}: a context of the daemon's would keep the "
                                       "trainers out")
                _retain(index)  # never released: the context lives as long as the daemon
                with torch.cuda.device(index):
                    torch.cuda.current_stream(index).query()  # the runtime takes it up now, not at the first copy
                state = (HELD, "")
            except (RuntimeError, OSError) as exc:
                state = (REFUSED, str(exc))
                if self._state.get(index, ("", ""))[1] != state[1]:
                    log.warning("%s", self._say(index, REFUSED, state[1]))
            self._state[index] = state
            return state

    def _uuid(self, index: int) -> str:
        return next((u for u, i in devices_by_uuid().items() if i == index), f"cuda:{index}")[:64]

    def _say(self, index: int, state: str, why: str) -> str:
        if state == BROKEN:
            return (f"datastatesd's CUDA context on GPU {self._uuid(index)} is broken by a sticky CUDA error ({why}): "
                    "it copies nothing from that GPU until it is restarted; its trainers' probes send them to "
                    "host copies meanwhile")
        return f"datastatesd cannot make a CUDA context on GPU {self._uuid(index)}: {why}"


gpus = Gpus()
"""The daemon's one view of its GPUs (a process has one context per GPU)."""
