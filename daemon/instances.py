"""Which daemons of this user run on this node, so a new one removes what killed ones left, and nothing of a live one.

Each daemon names itself with an owner tag: 8 hex digits of its host, 8 random ones of
this start. The tag goes into every temporary file it writes and into its replica folder
in /dev/shm, and the daemon holds an flock on ``/dev/shm/datastates-<uid>-daemons/<owner>.lock``
for as long as it runs (one folder per user and node, whatever the environment of each
daemon). A later daemon, on any endpoint, takes an owner whose lock file is there and free
as dead and removes its leftovers; a held lock is a live daemon's, and an owner with no
lock file is left alone (nothing proves it dead), so a live daemon's files in flight are
never touched, and another node's files never match this node's host digits.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import secrets
import socket
import time
from typing import Any, Awaitable, Callable, Container

from datastates.protocol.paths import SHM_DIR

OWNER_RE = re.compile(r"[0-9a-f]{16}")
"""An owner tag: host digits, then this start's digits."""


FORGET_AFTER_S = 7 * 86400
"""A dead writer's lock file whose roots no later daemon covered goes this long after its last sign of life
(``Instance.touch``; its leftovers then stay)."""

LIFE_SIGN_S = 3600.0
"""How often a running daemon renews its lock file's time (``Instance.touch``)."""


def _before_boot(path: str) -> bool:
    """Whether ``path`` last changed before this boot (the kernel's btime), when no process of now could have."""
    try:
        mtime = os.lstat(path).st_mtime
        with open("/proc/stat") as f:
            btime = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return False
    return mtime < btime


def daemons_folder() -> str:
    """This user's folder of daemon locks on this node (and what each daemon journals beside its lock)."""
    return os.path.join(SHM_DIR, f"datastates-{os.geteuid()}-daemons")


class Instance:
    def __init__(self, roots: list[str] | None = None) -> None:
        """``roots``: where this writer leaves temporary files, recorded in its lock file so that a later daemon
        forgets it only once it has cleaned all of them; None for the trainer's local fallback (anywhere)."""
        self.host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
        self.owner = self.host + secrets.token_hex(4)
        self.roots = roots or []
        self.folder = daemons_folder()
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self._fd = os.open(self._lock(self.owner), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, "\n".join(self.roots).encode())

    def record(self, folder: str) -> None:
        """Name ``folder`` in the lock file as one this writer leaves temporary files in: the trainer's local saver
        learns its folders as it saves (no daemon forgets such a lock but after FORGET_AFTER_S; a test session
        tells its own trainers' locks from another session's by them)."""
        if folder not in self.roots:
            self.roots.append(folder)
            os.pwrite(self._fd, "\n".join(self.roots).encode(), 0)

    def _lock(self, owner: str) -> str:
        return os.path.join(self.folder, f"{owner}.lock")

    def gone(self, owner: str, left: str | None = None) -> bool:
        """Whether the writer that tagged files with ``owner`` is dead: of this node, not this one, and its lock
        free; or, its lock file gone with /dev/shm in a reboot, ``left`` (a file or folder it left) last changed
        before this boot. Otherwise there is no proof of death (an older daemon, or a lock folder removed)."""
        if not OWNER_RE.fullmatch(owner) or not owner.startswith(self.host) or owner == self.owner:
            return False
        try:
            fd = os.open(self._lock(owner), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return left is not None and _before_boot(left)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def alone(self) -> bool:
        """Whether no other daemon of this user runs on this node."""
        owners = [n.removesuffix(".lock") for n in os.listdir(self.folder) if n.endswith(".lock")]
        return all(o == self.owner or self.gone(o) for o in owners)

    def dead(self) -> set[str]:
        """The owners whose lock file is here and free now: the writers a recovery starting now may forget once it
        has removed their leftovers. One that dies during that recovery is not among them: its leftovers were
        looked for while it lived (none taken), so it is left for the next daemon."""
        return {n.removesuffix(".lock") for n in os.listdir(self.folder)
                if n.endswith(".lock") and self.gone(n.removesuffix(".lock"))}

    def touch(self) -> None:
        """A sign of life: the lock file's time renewed, so FORGET_AFTER_S counts from this daemon's last one, not
        from its start (a daemon killed after a week's run would otherwise be forgotten at once)."""
        os.utime(self._fd)

    async def signs_of_life(self, stopped: asyncio.Event, run: Callable[..., Awaitable[Any]]) -> None:
        """``touch`` every LIFE_SIGN_S until ``stopped``, through ``run`` (the daemon's file-system threads)."""
        while not stopped.is_set():
            try:
                await asyncio.wait_for(stopped.wait(), LIFE_SIGN_S)
            except TimeoutError:
                with contextlib.suppress(OSError):
                    await run(self.touch)

    def forget_gone(self, dead: Container[str], kept: Container[str] = ()) -> None:
        """Remove the locks (and journals) of the ``dead`` writers whose leftovers this daemon has removed: all their
        roots are among its own, and none is in ``kept`` (some could not be removed). Another job's daemon on other
        roots leaves them for the next daemon there. Any of them silent for FORGET_AFTER_S goes all the same."""
        for name in os.listdir(self.folder):
            owner = name.removesuffix(".lock")
            if not name.endswith(".lock") or owner not in dead or not self.gone(owner):
                continue
            try:
                with open(self._lock(owner)) as f:
                    text = f.read()
                roots = text.split("\n") if text else []
                old = time.time() - os.stat(self._lock(owner)).st_mtime > FORGET_AFTER_S
                if old or (owner not in kept and roots and all(r in self.roots for r in roots)):
                    for leftover in [n for n in os.listdir(self.folder) if n.startswith(owner + ".") and n != name]:
                        os.unlink(os.path.join(self.folder, leftover))  # its journal
                    os.unlink(self._lock(owner))  # last: a lock file is what makes a later daemon look for the rest
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Release the lock, but leave its file: the next daemon then takes this owner as gone and removes
        what it could not (a temporary file in a folder that had turned read-only), then the lock file."""
        os.close(self._fd)
