"""Retention and the daemon's guards in run folders others share, and against a prune's stale listing (issue 27).

A run folder of mode 2775 (setgid, a project's group) or one made under umask 002 is one
readers may not trust (``untrusted_folder``), but the daemon's own guards must still see the
markers in it: they refuse a save over a committed file and keep the files a marker lists.
Retention must never delete a tag folder that holds another tag's marker, nor a tag
committed again after the prune listed it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.reader import verify
from datastates.protocol.errors import PathNotAllowedError

from conftest import DaemonProc, assert_state_equal, save


@pytest.mark.parametrize("mode", [0o2775, 0o775])
def test_a_group_writable_run_folder_keeps_the_save_guard(mode: int, daemon: DaemonProc) -> None:
    """Tag A's marker sits in the run folder beside its file f; a save of f under tag B is refused, and A stands.
    Before, the guard's marker lookup stopped at the group-writable folder, and B's file was renamed over A's."""
    run = daemon.root / "run"
    run.mkdir()
    os.chmod(run, mode)
    f = run / "f.pt"
    first = {"w": torch.arange(16.0), "step": 1}
    with Client(daemon.endpoint, timeout=60) as c:
        save(c, first, f, tag="A")
        assert (run / "datastates-commit.A.json").exists()
        with pytest.raises(PathNotAllowedError, match="committed tag"):
            save(c, {"w": torch.zeros(16), "step": 2}, f, tag="B")
    assert_state_equal(first, datastates.load(f))
    verify(str(f))
