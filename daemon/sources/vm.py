"""The trainer's CPU memory, read in place with ``process_vm_readv``: the default CPU kind.

Nothing is moved, mapped or opened: a source is an address in the client's process, and a
copy thread reads it straight into a pool chunk (one system call, GIL released; about 3 GB/s
a thread here, slower than a memcpy from a mapping: the kernel pins each page). So a snapshot leaves the trainer's tensors exactly as they were, costs
the daemon no file descriptor, and a range the trainer has unmapped meanwhile fails that
one read with EFAULT, never the daemon with SIGBUS.

Who may be read: only a client the daemon watches by pid (same host and pid namespace,
protocol/liveness.py) whose HELLO probe it read back, so the pid is the process that sent
it. The kernel allows the read only where ptrace would be (same user, and under Yama's
``ptrace_scope`` 1 only after the trainer named the daemon with ``PR_SET_PTRACER``, which
the client does). A client of the same user gains nothing it lacked: it could read that
memory itself.

Lifetime: like GPU memory, this memory goes with the trainer, so a snapshot is safe from a
trainer crash once it is copied (``wait()`` returned), not before; the job asks whether
the trainer still lives after its last read (``AdmittedSnapshot.mark_copied``), which also
catches a pid reused mid-copy.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from typing import Sequence

import torch

from datastates.protocol.descriptors import VM, SourceDesc
from datastates.protocol.errors import InvalidRequestError, SnapshotFailedError

from .base import CopySource, Owner, Region, register_source

_ADDRESS_RE = re.compile(r"^[0-9a-f]{1,16}$")


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)  # a foreign call releases the GIL: copy threads read in parallel
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                       ctypes.c_ulong, ctypes.c_ulong]
    _readv.restype = ctypes.c_ssize_t


IOV_MAX = 1024
"""The most iovecs one ``process_vm_readv`` takes (Linux's UIO_MAXIOV)."""


def read_process(pid: int, address: int, dst: int, length: int) -> None:
    """Copy ``length`` bytes at ``address`` in process ``pid`` to ``dst`` here; OSError on failure."""
    done = 0
    while done < length:
        done += _readv_once(pid, [(address + done, dst + done, length - done)])


def _readv_once(pid: int, reads: list[tuple[int, int, int]]) -> int:
    """One ``process_vm_readv`` of ``(address, dst, length)`` reads (at most IOV_MAX): the bytes it read, in order,
    which may stop short of them all; OSError if it read none."""
    if _readv is None:
        raise OSError(errno.ENOSYS, "this C library has no process_vm_readv")
    local, remote = (_IoVec * len(reads))(), (_IoVec * len(reads))()
    for i, (address, dst, length) in enumerate(reads):
        local[i].iov_base, local[i].iov_len = dst, length
        remote[i].iov_base, remote[i].iov_len = address, length
    n = _readv(pid, local, len(reads), remote, len(reads), 0)
    if n < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if n == 0:  # a partial read stops at an unmapped page: the next call would fail there
        raise OSError(errno.EFAULT, os.strerror(errno.EFAULT))
    return n


def probe(pid: int, probe_desc: str) -> str:
    """Why the daemon cannot read process ``pid`` in place; "" when it read back the probe the client sent.

    ``probe_desc`` is ``<address hex>:<bytes hex>``: bytes the client keeps at that address.
    """
    if not probe_desc:
        return "the client sent no probe (an older client, or capture='shm')"
    if pid == os.getpid():
        return "the client claims the daemon's own pid"
    address, _, expected_hex = probe_desc.partition(":")
    try:
        expected = bytes.fromhex(expected_hex)
    except ValueError:
        return "malformed probe"
    if not _ADDRESS_RE.match(address) or not 8 <= len(expected) <= 64:
        return "malformed probe"
    buf = ctypes.create_string_buffer(len(expected))
    try:
        read_process(pid, int(address, 16), ctypes.addressof(buf), len(expected))
    except OSError as exc:
        hint = (" (Yama ptrace_scope forbids it, or a seccomp profile does)" if exc.errno == errno.EPERM else "")
        return f"process_vm_readv of pid {pid}: {exc.strerror}{hint}"
    if buf.raw != expected:
        return f"pid {pid} is not the process that sent HELLO (its probe bytes differ)"
    return ""


class VmRegion(Region):
    """``nbytes`` at ``address`` in the trainer process; no ``tensor``: bytes arrive only through ``read_into``."""

    in_trainer = True

    def __init__(self, pid: int, address: int, nbytes: int) -> None:
        self.pid = pid
        self.address = address
        self.nbytes = nbytes

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> None:
        self.destination(dst, src, length)  # the bounds check; the kernel writes at dst's address itself
        self.read_into_address(dst.data_ptr(), src, length)
        return None

    def batch_key(self) -> int:
        return self.pid

    @staticmethod
    def read_batch(reads: Sequence[tuple[Region, int, int, int]]) -> None:
        """The reads of one trainer (one ``batch_key``) in as few system calls as IOV_MAX allows: 100,000 tiny
        tensors took 0.9 s of calls one by one. Where a call stops short, the rest goes on one by one, so a
        failure names the tensor it met."""
        checked = []
        for region, dst, src, length in reads:
            assert isinstance(region, VmRegion)
            if not 0 <= src <= src + length <= region.nbytes:
                raise ValueError(f"read of {length} bytes at {src} does not fit a {region.nbytes}-byte region")
            checked.append((region.address + src, dst, length))
        pid = reads[0][0].pid  # type: ignore[attr-defined]
        for start in range(0, len(checked), IOV_MAX):
            batch = checked[start:start + IOV_MAX]
            try:
                n = _readv_once(pid, batch)
            except OSError:
                n = 0
            if n == sum(length for _, _, length in batch):
                continue
            for region, dst, src, length in reads[start:start + IOV_MAX]:
                if n >= length:
                    n -= length
                    continue
                region.read_into_address(dst + n, src + n, length - n)  # type: ignore[attr-defined]
                n = 0

    def read_into_address(self, dst: int, src: int, length: int) -> None:
        """``read_into`` at a host address, its bounds checked by the caller."""
        try:
            read_process(self.pid, self.address + src, dst, length)
        except OSError as exc:
            raise self._failed(exc, src, length) from None

    def _failed(self, exc: OSError, src: int, length: int) -> SnapshotFailedError:
        if exc.errno == errno.ESRCH:
            why = f"its trainer (pid {self.pid}) exited before its state was copied"
        elif exc.errno == errno.EFAULT:
            why = (f"the trainer's memory at {self.address + src:#x} ({length} bytes) is no longer mapped: a "
                   "snapshotted tensor was freed or resized before wait() returned")
        else:
            why = f"reading the trainer's memory (pid {self.pid}) failed: {exc.strerror}"
        return SnapshotFailedError(why)


class VmSource(CopySource):
    kind = VM

    def open(self, desc: SourceDesc, owner: Owner) -> Region:
        if owner.readable:
            raise InvalidRequestError(f"a source of kind {VM!r} needs a client whose memory the daemon reads in "
                                      f"place, and it cannot read this one's: {owner.readable}")
        if not _ADDRESS_RE.match(desc.handle) or desc.nbytes <= 0:
            raise InvalidRequestError(f"bad {VM} source: address {desc.handle[:32]!r}, {desc.nbytes} bytes")
        address = int(desc.handle, 16)
        if address == 0 or address + desc.nbytes > 1 << 64:
            raise InvalidRequestError(f"{VM} source of {desc.nbytes} bytes at {address:#x} is outside any address space")
        return VmRegion(owner.pid, address, desc.nbytes)


register_source(VmSource())
