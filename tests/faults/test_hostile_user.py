"""Another local user plants a tag where this user's trainer restores from.

Under a root other users can write to (``/tmp`` in the shipped examples), a second user
creates ``run/step2/`` with a marker that sorts last. ``latest()``, ``Client.restore`` and
``ls`` must skip it, as ssh's StrictModes skips a key file others could have written, and
say why in the log. Above a root of this user's own (the documented ``/tmp/ckpt``), the
folder others write is the root's parent: a marker planted there that lists this user's
files, or a FIFO named like one, must change nothing for ``load``, ``verify``, the daemon's
admission or its SIGTERM. A real second user (``useradd``) does the planting.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify
from datastates.protocol.errors import CommitError
from datastates.protocol.format import marker_name

from conftest import DATASTATESCTL, DaemonProc, as_user, assert_state_equal, save, tmp_folder

def test_a_tag_planted_by_another_user_is_never_restored(mallory: str, open_tmp: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    tmp_path = open_tmp
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: everyone may create folders, the sticky bit keeps them apart
    run = shared / "run"
    run.mkdir()
    os.chmod(run, 0o1777)
    mine = {"w": torch.arange(6.0), "step": 1}
    with Client(f"ipc://{tmp_path}/no-daemon.sock", timeout=2, fallback="local") as c:  # saves in this process
        save(c, mine, run / "step1" / "model.pt", tag="step1")
    marker = json.loads((run / "step1" / "datastates-commit.step1.json").read_text())
    marker.update(tag="step2", sequence=marker["sequence"] + 1000)  # sorts last
    bait = tmp_path / "bait"
    bait.mkdir()
    (bait / "datastates-commit.step2.json").write_text(json.dumps(marker))
    shutil.copy(run / "step1" / "model.pt", bait / "model.pt")
    os.chmod(bait, 0o755)
    for f in bait.iterdir():
        os.chmod(f, 0o644)
    as_user(mallory, f"mkdir {run}/step2 && cp {bait}/model.pt {bait}/datastates-commit.step2.json {run}/step2/")
    assert (run / "step2").stat().st_uid == pwd.getpwnam(mallory).pw_uid

    with caplog.at_level(logging.WARNING):
        assert datastates.latest(run) == "step1"
    assert any("step2" in r.getMessage() and "not to this user" in r.getMessage() for r in caplog.records)
    with Client(f"ipc://{tmp_path}/no-daemon.sock", timeout=2, fallback="local") as c:
        restored = c.restore(run, "model.pt")
        assert restored is not None and restored.tag == "step1"
        assert_state_equal(mine, restored.state)
        with pytest.raises(CommitError, match="not committed"):
            c.restore(run, "model.pt", tag="step2")  # asked for by name, still not trusted

    os.chmod(run / "step1", 0o777)  # this user's own tag, but any user could have swapped its files
    assert datastates.latest(run) is None


SAVE = """
import sys, torch
from datastates.client import Client
with Client(sys.argv[1], timeout=60) as c:
    handle = c.snapshot({"w": torch.arange(8.0) * 2, "step": 2}, sys.argv[2])
    c.wait()
    c.commit(handle.tag).result(timeout=120)
"""
"""A trainer's save, in a process of its own: one that hangs (admission stuck on a FIFO) is killed at its timeout."""


@pytest.fixture
def like_tmp() -> Iterator[Path]:
    """A folder of mode 1777, as ``/tmp`` is: every user may create entries in it, each keeps its own."""
    with tmp_folder("ds-above-", 0o1777) as folder:
        yield folder


@pytest.mark.parametrize("plant", ["marker", "fifo"])
def test_a_marker_planted_above_the_root_changes_nothing(plant: str, mallory: str, like_tmp: Path,
                                                         start_daemon: Callable[..., DaemonProc]) -> None:
    """The root is ``<like_tmp>/ckpt``, as ``/tmp/ckpt``; another user plants, in ``<like_tmp>``, a whole marker
    listing this user's files (one committed, one about to be saved) under another snapshot, or a FIFO named like
    a marker. Formerly, the first made load and verify refuse the good file and the daemon refuse the save; the
    second hung all three, and the daemon's SIGTERM behind its stuck admission."""
    root = like_tmp / "ckpt"
    root.mkdir(mode=0o755)
    d = start_daemon(storage={"roots": [str(root)]})
    first, second = {"w": torch.arange(8.0), "step": 1}, {"w": torch.arange(8.0) * 2, "step": 2}
    with Client(d.endpoint, timeout=60) as c:
        save(c, first, root / "step1" / "model.pt")
    planted = like_tmp / marker_name("planted")
    if plant == "marker":
        marker = json.loads((root / "step1" / marker_name("step1")).read_text())
        size = (root / "step1" / "model.pt").stat().st_size
        marker.update(tag="planted", sequence=marker["sequence"] + 1000,
                      files=[{"path": f"ckpt/step{n}/model.pt", "size": size, "snapshot": "planted/by/another-user"}
                             for n in (1, 2)])
        as_user(mallory, f"printf %s {shlex.quote(json.dumps(marker))} > {planted}")
    else:
        as_user(mallory, f"mkfifo {planted}")
    assert planted.lstat().st_uid == pwd.getpwnam(mallory).pw_uid

    try:  # admission looks for the markers that list the path: none above the root
        out = subprocess.run([sys.executable, "-c", SAVE, d.endpoint, str(root / "step2" / "model.pt")],
                             capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail("the save of step2 hung")
    assert out.returncode == 0, out.stderr[-3000:]
    assert datastates.latest(root) == "step2"
    for step, state in ((1, first), (2, second)):
        path = root / f"step{step}" / "model.pt"
        assert_state_equal(state, datastates.load(path))
        verify(path)
        out = d.ctl("verify", str(path))
        assert out.returncode == 0, out.stdout + out.stderr
    assert d.stop() == 0  # SIGTERM drains and stops: no thread of it is stuck opening a FIFO


def pruned(root: Path) -> subprocess.CompletedProcess:
    """``datastatesctl prune --keep-last 1`` of ``root``, which must succeed; its output says what it left and why."""
    out = subprocess.run([DATASTATESCTL, "prune", str(root), "--keep-last", "1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_prune_leaves_another_users_folder_named_as_being_deleted(mallory: str, like_tmp: Path) -> None:
    """Under a root others may write in, a folder named like what a killed delete leaves (``.<tag>.<token>.dsdel``)
    is finished only if it is this user's: one another user made there is theirs, and ``prune`` leaves it."""
    planted = like_tmp / ".step9.0123abcd.dsdel"
    as_user(mallory, f"mkdir {planted} && touch {planted}/theirs")
    out = pruned(like_tmp)
    assert (planted / "theirs").exists(), "prune deleted a folder of another user's"
    assert "not finishing the delete" in out.stderr and f"uid {pwd.getpwnam(mallory).pw_uid}" in out.stderr, out.stderr


def test_prune_leaves_this_users_folder_another_user_renamed_as_being_deleted(mallory: str, open_tmp: Path) -> None:
    """In a run folder others may write (mode 777, no sticky bit), another user renames this user's committed tag
    folder to a killed delete's name (``.step10.<token>.dsdel``); this user's next ``prune`` leaves it, and says why.
    Before, only the folder's own owner was checked, and the prune deleted the committed tag."""
    run = open_tmp / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    mine = {"w": torch.arange(6.0), "step": 10}
    with Client(f"ipc://{open_tmp}/no-daemon.sock", timeout=2, fallback="local") as c:  # saves in this process
        save(c, mine, run / "step10" / "model.pt", tag="step10")
    renamed = run / ".step10.deadbeef.dsdel"
    as_user(mallory, f"mv {run}/step10 {renamed}")
    out = pruned(run)
    assert (renamed / "model.pt").exists(), "prune deleted this user's committed tag another user renamed"
    assert "not finishing the delete" in out.stderr and "writable by group or others" in out.stderr, out.stderr
    os.rename(renamed, run / "step10")
    assert_state_equal(mine, datastates.load(run / "step10" / "model.pt"))
