"""The daemon's replica folder in /dev/shm: the replica and spare files' names, their room, their removal.

Each daemon keeps its replicas in a folder of its own, ``/dev/shm/datastates-<uid>-<owner>``, so a daemon started
after a kill finds the killed one's folder by its owner and removes it (``remove_gone``). A replica's file is named
by its snapshot (job id) and file name; a superseded replica kept as a spare is renamed ``spare-<job id>``, a spare
allocated ahead is made as ``spare-ahead-<job id>``: the table (table.py) decides which to keep, this class only
names, makes, renames and removes them. A removal is announced (``on_removed``): the backend (backend.py) may still
map a removed file, and its pages are freed only once it lets go.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

from datastates.protocol.paths import SHM_DIR
from datastates.protocol.storage import Gone

SHM_HEADROOM = 256 << 20
"""/dev/shm left free beyond a replica: trainers' shared tensors live there too."""


def _folder_prefix() -> str:
    return os.path.join(SHM_DIR, f"datastates-{os.geteuid()}-")


def remove_gone(gone: Gone) -> list[str]:
    """The replica folders of killed daemons of this node (``gone`` owners), deleted: no one can restore from them."""
    removed = []
    prefix = _folder_prefix()
    for name in os.listdir(SHM_DIR):
        folder = os.path.join(SHM_DIR, name)
        if folder.startswith(prefix) and gone(folder[len(prefix):], folder) and not os.path.islink(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class ReplicaFolder:
    """One daemon's folder of replica and spare files."""

    def __init__(self, owner: str, on_removed: Callable[[], None]) -> None:
        self.path = _folder_prefix() + owner
        self._on_removed = on_removed
        """Called once files were removed: the replica backend may still map them (their pages are freed then)."""

    def make(self) -> None:
        """The folder, made where it is missing (never made yet, or removed under the daemon: a /dev/shm clean-up,
        systemd's RemoveIPC)."""
        if not os.path.isdir(self.path):
            os.makedirs(self.path, mode=0o700, exist_ok=True)

    def has_room(self, size: int, freed: int = 0) -> bool:
        """Whether /dev/shm holds ``size`` more bytes beyond its headroom, counting ``freed`` bytes a file written
        over gives back."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize + freed >= size + SHM_HEADROOM

    def replica_file(self, job_id: int, path: str) -> str:
        """The file of snapshot ``job_id``'s replica of ``path``."""
        return os.path.join(self.path, f"{job_id}-{os.path.basename(path)}")

    def keep_as_spare(self, file: str, job_id: int) -> str:
        """Replica ``file`` renamed as a spare, for the next replica of its rank file to write over; "" where it
        cannot be (never written: a failed snapshot, or removed under the daemon)."""
        spare = os.path.join(self.path, f"spare-{job_id}")
        try:
            os.rename(file, spare)
        except OSError:
            return ""
        return spare

    def new_spare(self, job_id: int) -> str:
        """An empty file for a spare allocated ahead, after snapshot ``job_id``'s replica; OSError where it cannot
        be made."""
        file = os.path.join(self.path, f"spare-ahead-{job_id}")
        os.close(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))
        return file

    def remove(self, *paths: str) -> None:
        """Unlink each of ``paths`` ("" is none), and announce it."""
        for path in paths:
            if path:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if any(paths):
            self._on_removed()

    def close(self) -> None:
        """The folder and every file in it deleted: a stopped daemon's replicas serve no one."""
        shutil.rmtree(self.path, ignore_errors=True)
