"""Telling whether a peer process still lives, when both sides share a host and a pid namespace."""

from __future__ import annotations

import os


def pid_namespace() -> int:
    """This process's pid namespace (an inode number), or 0 where /proc does not tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks, which a reused pid does not share; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
    return fields[19] if len(fields) > 19 else None
