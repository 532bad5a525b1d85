"""The CUDA runtime library this process loaded, for the calls torch's bindings lack: one place for the trainer's
client and the daemon alike.

torch exposes neither stream flags nor ``cudaGetLastError``. Both sides need a stream of
their own (``own_stream``): torch's pool hands its 32 streams per device out round-robin,
so a pool stream may be one the trainer, or another thread, queues its work on. Importing
this module never touches CUDA; ``own_stream`` needs a CUDA device.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

log = logging.getLogger(__name__)

STREAM_NON_BLOCKING = 1
"""cudaStreamNonBlocking: a stream that never waits for the legacy NULL stream, as torch's own are."""


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
