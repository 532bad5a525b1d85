"""Which dead writers a daemon's recovery forgets (daemon/instances.py): their lock file, and their upload journal
beside it, are what tells a later daemon that leftovers may remain. Real processes hold real flocks in this user's
daemons folder; each test's owners are its own.

- a writer alive when a recovery starts and killed during it is not forgotten by that recovery (its leftovers were
  looked for while it lived, none taken): the next one forgets it;
- a writer whose leftovers could not all be removed (``kept``: its uploads could not be listed) stays;
- FORGET_AFTER_S counts from a writer's last sign of life (``touch``), not from its start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from datastates.daemon.instances import FORGET_AFTER_S, Instance

HOLDER = r"""
import sys
from datastates.daemon.instances import Instance
me = Instance([sys.argv[1]])
print(me.owner, flush=True)
for line in sys.stdin:  # each line: a sign of life
    me.touch()
    print("touched", flush=True)
"""


class Writer:
    """Another writer of this node: a process holding its lock, with ``root`` as its one root."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.owner = self.proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert self.owner, "the writer did not start"

    def touch(self) -> None:
        self.proc.stdin.write("\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        assert self.proc.stdout.readline().strip() == "touched"  # type: ignore[union-attr]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def files(self, me: Instance) -> list[str]:
        return sorted(n for n in os.listdir(me.folder) if n.startswith(self.owner + "."))


@pytest.fixture
def writers() -> Iterator[list[Writer]]:
    made: list[Writer] = []
    yield made
    for w in made:
        w.kill()


@pytest.fixture
def me(tmp_path: Path) -> Iterator[Instance]:
    """This test's daemon, whose one root is ``tmp_path/root``; its lock file goes with it."""
    mine = Instance([str(tmp_path / "root")])
    yield mine
    mine.close()
    os.unlink(os.path.join(mine.folder, f"{mine.owner}.lock"))


def lock_age(me: Instance, owner: str, seconds: float) -> None:
    """Set the lock file of ``owner`` as last touched ``seconds`` ago."""
    then = time.time() - seconds
    os.utime(os.path.join(me.folder, f"{owner}.lock"), (then, then))


def test_a_writer_killed_during_a_recovery_is_left_to_the_next_recovery(
        tmp_path: Path, writers: list[Writer], me: Instance) -> None:
    other = Writer(tmp_path / "root")
    writers.append(other)
    dead = me.dead()  # the recovery starts: the other writer lives
    assert other.owner not in dead
    other.kill()  # and dies before the recovery forgets anyone
    assert me.gone(other.owner)
    me.forget_gone(dead)
    assert other.files(me) == [f"{other.owner}.lock"], "forgotten by a recovery that looked for nothing of it"
    me.forget_gone(me.dead())  # the next recovery: dead from its start, its roots all among ours
    assert other.files(me) == []


def test_a_writer_whose_leftovers_could_not_all_be_removed_stays_until_forget_after(
        tmp_path: Path, writers: list[Writer], me: Instance) -> None:
    other = Writer(tmp_path / "root")
    writers.append(other)
    other.kill()
    with open(os.path.join(me.folder, f"{other.owner}.uploads"), "w") as f:
        f.write("bucket upload-1\n")
    me.forget_gone(me.dead(), kept={other.owner})  # its uploads could not be listed
    assert other.files(me) == [f"{other.owner}.lock", f"{other.owner}.uploads"]
    lock_age(me, other.owner, FORGET_AFTER_S + 60)  # silent for longer than FORGET_AFTER_S
    me.forget_gone(me.dead(), kept={other.owner})
    assert other.files(me) == []


def test_forget_after_counts_from_a_writers_last_sign_of_life_not_its_start(
        tmp_path: Path, writers: list[Writer], me: Instance) -> None:
    ran_long = Writer(tmp_path / "theirs")  # another job's writer, on roots not ours
    writers.append(ran_long)
    lock_age(me, ran_long.owner, FORGET_AFTER_S + 60)  # started more than FORGET_AFTER_S ago ...
    ran_long.touch()  # ... alive all along (a daemon touches its lock every LIFE_SIGN_S)
    ran_long.kill()  # and killed just now
    me.forget_gone(me.dead())
    assert ran_long.files(me) == [f"{ran_long.owner}.lock"], "forgotten at once for its start's age"
    lock_age(me, ran_long.owner, FORGET_AFTER_S + 60)  # silent that long since
    me.forget_gone(me.dead())
    assert ran_long.files(me) == []
