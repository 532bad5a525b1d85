"""Telling whether a peer process still lives, when both sides share a host and a pid namespace."""

from __future__ import annotations

import os
import time

_DEAD_STATES = frozenset("ZXx")
"""/proc/<pid>/stat states of a process that has exited: zombie, dead."""
PF_EXITING = 0x4
"""The kernel's per-task flag (stat field 9) set once a process has begun to exit."""


def pid_namespace() -> int:
    """This process's pid namespace (an inode number), or 0 where /proc does not tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks, which a reused pid does not share; None if it is gone.

    A process that is exiting or a zombie is gone too: by then the kernel has torn down
    (or is tearing down) its memory and its CUDA context, so its GPU memory no longer holds
    what it held, and a copy that raced its death read nothing it can vouch for.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
    if len(fields) <= 19 or fields[0] in _DEAD_STATES or int(fields[6]) & PF_EXITING:
        return None
    return fields[19]


def process_began_ns(pid: int) -> int:
    """When process ``pid`` started, on the wall clock (ns, to a clock tick), or 0 where /proc does not tell. A rank's
    start precedes every collective it takes part in, so no other node's part of a tag of its attempt is older than
    it (daemon/gather.py). From the time since boot, not /proc/stat's ``btime``, which is kept to the second."""
    started = process_start(pid)
    if started is None:
        return 0
    since_start_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - int(started) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    return time.time_ns() - since_start_ns


def shares_pids(pidns: int, started: str, pid: int) -> bool:
    """Whether a peer that reported namespace ``pidns`` and start time ``started`` for its ``pid`` is
    watchable here by that pid (the caller checks the host is the same).

    The namespaces' inode numbers decide where both sides can read them. Some kernels and
    sandboxes (gVisor) have no /proc/self/ns/pid; there a pid that shows here the start time
    the peer read for itself is taken as the same process.
    """
    here = pid_namespace()
    if pidns and here:
        return pidns == here
    return bool(started) and process_start(pid) == started
