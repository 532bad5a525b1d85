"""Letting the daemon read this process's CPU tensors in place (daemon/sources/vm.py).

The client proves at HELLO that it is the process its pid names: it keeps a few random
bytes at a fixed address and sends both; the daemon reads them back there. Where Yama's
``ptrace_scope`` is 1 (Ubuntu's default), only a process's ancestors may read it, and the
daemon is a sibling started by the job script, so the client first names the daemon as its
one permitted reader (``PR_SET_PTRACER``), which allows that daemon and nothing else.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

PR_SET_PTRACER = 0x59616D61
"""prctl option: let one given pid attach (Yama's exception for a non-ancestor)."""
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


class Probe:
    """Random bytes at a fixed address for this client's lifetime, and their HELLO form."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(os.urandom(16), 16)

    def __str__(self) -> str:
        return f"{ctypes.addressof(self._buf):x}:{self._buf.raw.hex()}"


def yama_scope() -> int:
    """Yama's ptrace_scope, 0 where Yama is absent."""
    try:
        with open(_YAMA_SCOPE) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def allow_reader(pid: int) -> None:
    """Under Yama scope 1, let process ``pid`` (the daemon) read this one; a failure only means shared memory instead."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        log.info("prctl(PR_SET_PTRACER, %d) failed (%s): CPU tensors go through shared memory",
                 pid, os.strerror(ctypes.get_errno()))
