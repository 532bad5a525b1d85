"""One outcome per snapshot, agreed by trainer and daemon without a round trip (invariant I3).

A trainer that hears nothing from its daemon for ``liveness`` seconds gives up on the
snapshots not yet confirmed copied, and goes on changing its tensors. A daemon that was
only stalled (SIGSTOP, swapping, a hung NFS write) must then never finish, rename or
commit those snapshots: it would copy memory the trainer has since changed.

The two sides race to create one decision object per snapshot, a symbolic link in the
client's own folder under /dev/shm, named by the snapshot's ticket: the daemon creates it
pointing to ``copied`` when the last byte is copied, before it answers WAIT; the client
creates it pointing to ``abandoned`` when it gives up. ``symlink`` is atomic and fails if
the name exists, so exactly one wins, and the loser reads the winner with ``readlink``. No
side holds a lock a stopped process could keep, and the client's side is one system call,
made only when it gives up. The client never removes an ``abandoned`` link; the daemon
removes the folder once the client is gone and none of its snapshots is still pending.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil

from .errors import InvalidRequestError
from .paths import SHM_DIR

COPIED = "copied"
ABANDONED = "abandoned"
TICKET_RE = re.compile(r"[0-9]{1,20}")
_FOLDER_RE = re.compile(r"datastates-(\d+)-client-(\d+)-[0-9a-f]{8}")


def make_folder() -> str:
    """A fresh folder for this client's decisions, private to its user."""
    folder = os.path.join(SHM_DIR, f"datastates-{os.geteuid()}-client-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(folder, 0o700)
    return folder


def check_folder(folder: str) -> str:
    """``folder`` if it is a decision folder of this user under /dev/shm; InvalidRequestError otherwise."""
    if not folder:
        return ""
    name = os.path.basename(folder)
    match = _FOLDER_RE.fullmatch(name)
    if os.path.dirname(folder) != SHM_DIR or not match or int(match.group(1)) != os.geteuid():
        raise InvalidRequestError(f"decision folder {folder[:256]!r} is not one of this user's under {SHM_DIR}")
    try:
        st = os.lstat(folder)
    except OSError:
        raise InvalidRequestError(f"decision folder {folder!r} does not exist") from None
    if not os.path.isdir(folder) or os.path.islink(folder) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise InvalidRequestError(f"decision folder {folder!r} must be this user's own folder with mode 0700")
    return folder


def check_ticket(ticket: str) -> str:
    if ticket and not TICKET_RE.fullmatch(ticket):
        raise InvalidRequestError(f"snapshot ticket {ticket[:32]!r} is not a decimal number")
    return ticket


def decide(folder: str, ticket: str, outcome: str) -> str:
    """Claim ``outcome`` for the snapshot ``ticket``; the outcome that holds (ours, or the one claimed first).

    A folder that no longer exists holds no claim either side can read, so ``abandoned``
    holds: a daemon that tidied the folder of a client it took as gone while one of its
    snapshots was still being admitted, or one that cannot see the client's pid, must not
    take the copy for good when the client may have given up and stepped.
    """
    path = os.path.join(folder, ticket)
    try:
        os.symlink(outcome, path)
        return outcome
    except FileExistsError:
        return os.readlink(path)
    except FileNotFoundError:
        return ABANDONED


LEFT = "left"
"""A name no ticket takes (tickets are decimal): the client's word that it will never talk to this daemon again."""
LOCAL = "local"
"""Where ``LEFT`` points when the client went on saving in its own process (``fallback="local"``)."""


def leave(folder: str, local: bool = False) -> None:
    """Say, where a stalled daemon finds it on resuming, that this client went on without it.

    ``local``: it now writes its checkpoints itself, to the same paths. Said before its first
    local write, so a resumed daemon that sees it never renames a file or writes a marker for
    this client again: two writers of one path would leave a file that its marker does not name.
    """
    try:
        os.symlink(LOCAL if local else LEFT, os.path.join(folder, LEFT))
    except (FileExistsError, FileNotFoundError):  # said already, or no daemon ever had the folder
        pass


def has_left(folder: str) -> bool:
    """Whether the client said it left (``leave``), or removed its folder.

    A client removes its folder only where its HELLO failed (client.py ``_connect``): a
    daemon that welcomed it all the same (the WELCOME came after the client stopped
    waiting: a daemon stalled just then) would otherwise hold it for as long as its pid lives.
    """
    return os.path.lexists(os.path.join(folder, LEFT)) or not os.path.lexists(folder)


def went_local(folder: str) -> bool:
    """Whether the client left to save in its own process (see ``leave``)."""
    try:
        return os.readlink(os.path.join(folder, LEFT)) == LOCAL
    except OSError:
        return False


def forget(folder: str, ticket: str) -> None:
    """Drop a ``copied`` decision the client has heard of: it will never give up on that snapshot."""
    try:
        os.unlink(os.path.join(folder, ticket))
    except FileNotFoundError:
        pass


def remove_dead_client_folders() -> list[str]:
    """Delete the decision folders of this user whose client process is gone; the folders deleted.

    Only for a daemon alone on its node: another daemon may still need a dead client's ``abandoned``.
    """
    out = []
    for name in os.listdir(SHM_DIR):
        match = _FOLDER_RE.fullmatch(name)
        if match and int(match.group(1)) == os.geteuid() and not os.path.exists(f"/proc/{match.group(2)}"):
            shutil.rmtree(os.path.join(SHM_DIR, name), ignore_errors=True)
            out.append(os.path.join(SHM_DIR, name))
    return out
