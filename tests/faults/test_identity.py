"""Each file names the snapshot it holds, and its tag's marker names it too: a swapped file is refused.

Two files of one shape from different snapshots have the same size and sound checksums, so
a tag whose file was replaced by another snapshot's (a mix across files: a stray copy, a
rename race) passed every check before. Now ``load``, ``verify`` and ``Client.restore``
compare the file's snapshot with the one its tag's marker lists, and refuse a mismatch
with an error naming both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import CorruptCheckpointError
from datastates.protocol.format import marker_name

from conftest import DaemonProc, save


def state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "step": step}


def test_a_file_swapped_for_another_snapshots_is_refused_by_load_verify_and_restore(
        shared_daemon: DaemonProc, shared_client: Client, tmp_path: Path) -> None:
    run = shared_daemon.root / "identity"
    for step in (1, 2):
        save(shared_client, state(step), run / f"step{step}" / "m.pt")
    marker = json.loads((run / "step1" / marker_name("step1")).read_text())
    assert marker["files"][0]["snapshot"], marker  # the marker names the snapshot of each file
    assert datastates.load(run / "step1" / "m.pt")["step"] == 1

    shutil.copyfile(run / "step2" / "m.pt", run / "step1" / "m.pt")  # same size, sound checksums, wrong step
    with pytest.raises(CorruptCheckpointError, match="replaced after the tag was committed") as err:
        datastates.load(run / "step1" / "m.pt")
    assert "step1" in str(err.value) and marker["files"][0]["snapshot"] in str(err.value)
    out = shared_daemon.ctl("verify", str(run / "step1"))
    assert out.returncode == 1 and "CORRUPT" in out.stdout and "replaced" in out.stdout, out.stdout
    with pytest.raises(CorruptCheckpointError):
        shared_client.restore(run, "m.pt", tag="step1")
    assert datastates.load(run / "step2" / "m.pt")["step"] == 2  # the file where it belongs still loads
