"""The CUDA runtime library this process loaded, for the calls torch's bindings lack: one place for the trainer's
client and the daemon alike.

torch exposes neither stream flags nor ``cudaGetLastError``. Both sides need a stream of
their own (``own_stream``): torch's pool hands its 32 streams per device out round-robin,
so a pool stream may be one the trainer, or another thread, queues its work on. Both
page-lock memory they already hold (``host_register``): the daemon its pool's chunks, the
reader its bounce buffers. Importing this module never touches CUDA; the calls need a
CUDA device.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

STREAM_NON_BLOCKING = 1
"""cudaStreamNonBlocking: a stream that never waits for the legacy NULL stream, as torch's own are."""
HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: page-locked for every device's context, so one buffer serves all the node's GPUs."""


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library torch calls, as this process loaded it; None where torch links it statically."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "/libcudart.so" in path:
                lib = ctypes.CDLL(path)
                lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
                return lib
    return None


def clear_error() -> None:
    """Reset this thread's last CUDA runtime error, which a failed call leaves for the next one to report."""
    lib = runtime()
    if lib is not None:
        lib.cudaGetLastError()


def host_register(address: int, size: int) -> int:
    """Page-lock ``size`` bytes at ``address`` for every GPU (under the current device's context); the cudaError
    code, 0 when registered. A failure is cleared at once: this thread's next CUDA call must not report it."""
    code = int(torch.cuda.cudart().cudaHostRegister(address, size, HOST_REGISTER_PORTABLE))
    if code:
        clear_error()
    return code


def host_unregister(address: int) -> None:
    """Undo ``host_register`` of the memory at ``address``, before it is freed."""
    torch.cuda.cudart().cudaHostUnregister(address)


def own_stream(index: int) -> torch.cuda.Stream:
    """A new stream on GPU ``index``, this process's alone (its caller caches it); a stream from torch's pool,
    logged at debug, where libcudart is not loaded as a library or the call fails."""
    lib = runtime()
    why = "libcudart is not loaded as a shared library"
    if lib is not None:
        stream = ctypes.c_void_p()
        with torch.cuda.device(index):
            torch.cuda.set_device(index)  # the runtime's current device for real, not one torch only noted
            err = lib.cudaStreamCreateWithFlags(ctypes.byref(stream), STREAM_NON_BLOCKING)
            if err == 0:
                return torch.cuda.ExternalStream(stream.value, device=torch.device("cuda", index))
            lib.cudaGetLastError()  # this thread's next CUDA call must not report it as its own
        why = f"cudaStreamCreateWithFlags failed (cudaError {err})"
    log.debug("a stream from torch's pool on cuda:%d: %s", index, why)
    return torch.cuda.Stream(index)
