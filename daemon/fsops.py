"""The daemon's own count of its file-system metadata operations, for ``status`` (issue 31).

Why: on a parallel file system the metadata server is the scarcest resource of a large
cluster, and a multi-node commit costs it more the more nodes there are. An operator
reads this count in ``status`` rather than attaching ``strace`` to a production daemon.

How: Python raises an audit event (``sys.addaudithook``) for every open, listing,
rename, unlink and mkdir of every thread, so the hook misses none. stat and fsync raise none: ``install`` wraps ``os.stat``, ``os.lstat`` and
``os.fsync`` (``os.path.exists`` and pathlib call them through the module, so they are
counted too). Descriptor-only calls (``fstat`` of what was opened) are not counted:
the open that made the descriptor was.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

EVENTS = {
    "open": "open",
    "os.listdir": "list",
    "os.scandir": "list",
    "os.rename": "rename",
    "os.remove": "unlink",
    "os.rmdir": "unlink",
    "os.mkdir": "mkdir",
    "datastates.rename": "rename",  # renameat2 through ctypes (protocol/fileio.py rename_within) raises its own
}
"""Audit event → category counted; the categories are ``status``'s keys."""

CATEGORIES = ("open", "stat", "list", "rename", "unlink", "mkdir", "fsync")

_counts = dict.fromkeys(CATEGORIES, 0)
_lock = threading.Lock()


def count(category: str) -> None:
    with _lock:
        _counts[category] += 1


def _hook(event: str, args: tuple[Any, ...]) -> None:
    category = EVENTS.get(event)
    if category is not None:
        count(category)


def _counted(category: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        count(category)
        return func(*args, **kwargs)

    call.__wrapped__ = func  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Count from now on, for the rest of the process (an audit hook cannot be removed): the daemon's start only."""
    sys.addaudithook(_hook)
    os.stat = _counted("stat", os.stat)
    os.lstat = _counted("stat", os.lstat)
    os.fsync = _counted("fsync", os.fsync)


def counts() -> dict[str, int]:
    """Operations since the daemon started, by category."""
    with _lock:
        return dict(_counts)
