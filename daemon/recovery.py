"""Clean-up after a kill: the one entry that removes what killed daemons of this node left, at a daemon's start.

A daemon killed mid-save leaves temporary files and done markers under the roots and in
object stores, new versions' staging folders and half-deleted tag folders, its replica
folder in /dev/shm, and its lock file (with its journal); its trainers leave decision
folders. Only what a dead writer left is touched (``Instance.gone``): a live daemon's
files in flight never are. The daemon admits no snapshot before this is over, since a new
file's path may be one a leftover holds.
"""

from __future__ import annotations

from datastates.protocol import outcome

from .config import StorageConfig
from .engine import Engine
from .instances import Instance
from .replica.folder import remove_gone
from .resave import Versions


async def clean_up_after_kill(engine: Engine, storage: StorageConfig, instance: Instance) -> list[str]:
    """Remove every leftover of this node's dead writers, then forget those writers; the paths removed.

    Staging folders go first: removing a temporary file inside one renews its mtime. A dead
    client's decision folders go only when no other daemon runs here (one may still need a
    dead client's "abandoned" decisions). A dead writer is forgotten (its lock file removed)
    only once nothing it left is still kept (``StorageWriter.kept``).
    """
    gone = instance.gone
    dead = await engine.flush(instance.dead)
    removed: list[str] = []
    for root in storage.roots:
        removed += await engine.flush(Versions.remove_leftovers, root, gone)
    written, kept = await engine.remove_leftovers(storage.written, gone)
    removed += written + await engine.flush(remove_gone, gone)
    if instance.alone():
        removed += await engine.flush(outcome.remove_dead_client_folders)
    await engine.flush(instance.forget_gone, dead, kept)
    return removed
