"""Page-locking the host pool's chunks for the GPU path, once per chunk.

A device-to-host copy runs asynchronously, at the link's speed, only into page-locked
memory; into pageable memory the driver stages it through a bounce buffer and blocks.
The pool's chunks are mapped once and never freed (``daemon/memory.py``), so each one is
registered in place with ``cudaHostRegister`` when it is mapped, instead of allocating a
second, pinned pool. Registering costs milliseconds per GB, which is why it is never
done per copy. Without CUDA every call here is a no-op.
"""

from __future__ import annotations

import threading

import torch

HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable: pinned for every device's context, since one pool serves all the node's GPUs."""

_lock = threading.Lock()
_pinned: set[int] = set()
"""Base addresses registered by this process: registering twice is a CUDA error."""


def _check(err: object, what: str) -> None:
    code = int(err)  # type: ignore[call-overload]
    if code != 0:
        raise RuntimeError(f"{what} failed with cudaError {code}")


def pin(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory behind ``tensor`` (contiguous, CPU); whether it is pinned now."""
    if not torch.cuda.is_available():
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("pin needs a contiguous CPU tensor")
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    with _lock:
        if ptr in _pinned or size == 0:
            return size > 0
        _check(torch.cuda.cudart().cudaHostRegister(ptr, size, HOST_REGISTER_PORTABLE), f"cudaHostRegister of {size} bytes")
        _pinned.add(ptr)
    return True
