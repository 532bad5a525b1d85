"""Page-locking the host pool's chunks for the GPU path, once per chunk.

A device-to-host copy runs asynchronously, at the link's speed, only into page-locked
memory; into pageable memory the driver stages it through a bounce buffer and blocks.
The pool's chunks are mapped once and never freed (``daemon/memory.py``), so each one is
registered in place with ``cudaHostRegister`` when it is mapped, instead of allocating a
second, pinned pool. Registering costs milliseconds per GB, which is why it is never
done per copy. Without CUDA every call here is a no-op.

- Registering needs a CUDA context, and one registration serves every GPU (portable). It
  is tried under each GPU's context in turn, only those daemon/gpus.py holds: a GPU it
  refused (full, or not in the default compute mode) would get a context here, taken from
  its trainers' memory or locking them out; a broken one fails. GPU 0 in
  EXCLUSIVE_PROCESS mode, or full, must not leave the whole pool unpinned.
- A failed CUDA runtime call also leaves its error as the calling thread's last error,
  which a later, unrelated torch call on that pool thread would report as its own: it is
  cleared at once.
- On a node of several NUMA nodes, a chunk's pages are first spread over all of them
  (interleaved): the pool serves every GPU of the node, and first-touch placement would
  put it all on the socket of whichever thread mapped it, so that the GPUs of the other
  socket copy across the inter-socket link for every byte.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from datastates.protocol.cudart import host_register

from .gpus import gpus

log = logging.getLogger(__name__)

MPOL_INTERLEAVE, MPOL_MF_MOVE = 3, 2
"""linux/mempolicy.h."""
SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
"""mbind(2)'s system call number (glibc has no wrapper; libnuma is not a dependency)."""

_lock = threading.Lock()
_pinned: set[int] = set()
"""Base addresses registered by this process: registering twice is a CUDA error."""


def numa_nodes() -> list[int]:
    """The online NUMA nodes (``/sys/devices/system/node/online``: "0", "0-1", "0,2-3"); [0] if unknown."""
    try:
        with open("/sys/devices/system/node/online") as f:
            spans = f.read().strip().split(",")
    except OSError:
        return [0]
    nodes = []
    for span in spans:
        lo, _, hi = span.partition("-")
        nodes += range(int(lo), int(hi or lo) + 1)
    return nodes


def interleave(address: int, size: int, nodes: list[int]) -> None:
    """Spread the pages of ``address..address+size`` over ``nodes``, moving those already placed; best effort."""
    number = SYS_MBIND.get(os.uname().machine)
    if number is None or len(nodes) < 2:
        return
    bits = 64
    mask = (ctypes.c_ulong * (max(nodes) // bits + 1))()
    for node in nodes:
        mask[node // bits] |= 1 << (node % bits)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, ctypes.c_void_p(address), ctypes.c_size_t(size), MPOL_INTERLEAVE, mask,
                    ctypes.c_ulong(len(mask) * bits + 1), MPOL_MF_MOVE) != 0:
        log.warning("the pool's pages stay where they were first touched: mbind failed (%s)",
                    os.strerror(ctypes.get_errno()))


def _register(ptr: int, size: int) -> None:
    """``cudaHostRegister`` under the first GPU context that takes it, only ever one ``gpus`` holds; RuntimeError
    with each GPU's refusal."""
    refusals = []
    for index in range(torch.cuda.device_count()):
        why = gpus.not_held(index)
        if why:
            refusals.append(f"cuda:{index}: context {why}")
            continue
        with torch.cuda.device(index):
            code = host_register(ptr, size)  # a failure is cleared: the pool thread's next call must not see it
            if code == 0:
                return
        refusals.append(f"cuda:{index}: cudaError {code}")
    raise RuntimeError(f"cudaHostRegister of {size} bytes failed under every GPU's context ({', '.join(refusals)})")


def page_lock(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory behind ``tensor`` (contiguous, CPU); whether it is pinned now."""
    if not torch.cuda.is_available():
        return False
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("page_lock needs a contiguous CPU tensor")
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    with _lock:
        if ptr in _pinned or size == 0:
            return size > 0
        interleave(ptr, size, numa_nodes())  # before the pages are locked where they are
        _register(ptr, size)
        _pinned.add(ptr)
    return True
