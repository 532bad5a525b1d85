"""Another local user plants a tag where this user's trainer restores from (issue 14, item 1).

Under a root other users can write to (``/tmp`` in the shipped examples), a second user
creates ``run/step2/`` with a marker that sorts last. ``latest()``, ``Client.restore`` and
``ls`` must skip it, as ssh's StrictModes skips a key file others could have written, and
say why in the log. A real second user (``useradd``) does the planting.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
from pathlib import Path

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import CommitError

from conftest import as_user, assert_state_equal, save

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
