"""The daemon's own count of its file-system metadata operations, for ``status``.

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
_lock = threading.RLock()
"""Reentrant: a collection inside ``counts`` may run a finalizer that opens a file, on the same thread."""


def count(category: str, counts: dict[str, int] = _counts, lock: Any = _lock) -> None:
    with lock:
        counts[category] += 1


def _hook(event: str, args: tuple[Any, ...], events: dict[str, str] = EVENTS, count: Callable[[str], None] = count) -> None:
    """Bound to its names as defaults: at interpreter shutdown module globals are gone, and a hook that raised
    would fail the open it was told of (a finalizer's)."""
    try:
        category = events.get(event)
        if category is not None and not (event == "open" and isinstance(args[0], int)):  # a descriptor: no lookup
            count(category)
    except Exception:  # never fail the operation being counted
        pass


def _counted(category: str, func: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        count(category)
        return func(*args, **kwargs)

    call.__wrapped__ = func  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Count from now on, for the rest of the process (an audit hook cannot be removed): the daemon's start only,
    once. Each wrapper joins the ``os.supports_*`` sets its function is in, so ``shutil`` and others that ask them
    still pass descriptors and ``follow_symlinks``."""
    if getattr(os.stat, "__wrapped__", None) is not None:
        return
    sys.addaudithook(_hook)
    for name, category in (("stat", "stat"), ("lstat", "stat"), ("fsync", "fsync")):
        func = getattr(os, name)
        wrapper = _counted(category, func)
        for supports in (os.supports_dir_fd, os.supports_fd, os.supports_follow_symlinks, os.supports_effective_ids):
            if func in supports:
                supports.add(wrapper)
        setattr(os, name, wrapper)


def counts() -> dict[str, int]:
    """Operations since the daemon started, by category."""
    with _lock:
        return dict(_counts)
