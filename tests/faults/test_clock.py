"""I4, the job's own order: a clock step on any node changes nothing.

``latest()``, the ``latest`` tracker and ``keep_last`` order tags by the marker's
``sequence`` (the run's commit order, fixed when the commit was asked for), never by a
wall clock. A marker written by a node whose clock ran 600 s ahead (or before an NTP step
back) used to make the next commits report success and be deleted at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

import datastates
from datastates.client import Client
from datastates.protocol.format import TRACKER, marker_name

from conftest import DaemonProc, assert_state_equal, save

AHEAD_NS = 600 * 10**9


def state(step: int) -> dict:
    return {"w": torch.full((256, 64), float(step)), "step": step}


def shift_clock(folder: Path, tag: str, legacy: bool = False) -> None:
    """Rewrite a committed marker as a node whose clock ran 600 s ahead would have written it."""
    path = folder / marker_name(tag)
    marker = json.loads(path.read_text())
    marker["requested_ns"] += AHEAD_NS
    marker["committed_ns"] += AHEAD_NS
    if legacy:  # written before markers had a sequence
        marker.pop("sequence")
    path.write_text(json.dumps(marker))


def assert_newest(run: Path, tag: str, step: int) -> None:
    """The tag a user was told is committed is the one latest() and the tracker name, whole, and nothing newer went."""
    assert datastates.latest(run) == tag
    assert (run / TRACKER).read_text() == tag
    assert_state_equal(state(step), datastates.load(run / tag / "m.pt"))


def test_a_marker_from_a_clock_ahead_neither_hides_nor_prunes_newer_commits(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    cfg = {"storage": {"roots": [str(root)], "keep_last": 1}}
    d = start_daemon(**cfg)
    run = d.root / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), run / "step1" / "m.pt")
        shift_clock(run / "step1", "step1")
        for step in (2, 3):
            save(c, state(step), run / f"step{step}" / "m.pt")
            assert_newest(run, f"step{step}", step)
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["step3"]  # keep_last 1: the older ones went

    # A marker of the old format (no sequence) from a clock ahead, and a daemon that reads the run anew.
    shift_clock(run / "step3", "step3", legacy=True)
    d.stop()
    d = start_daemon(**cfg)
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(4), run / "step4" / "m.pt")
    assert_newest(run, "step4", 4)
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["step4"]
    assert json.loads((run / "step4" / marker_name("step4")).read_text())["sequence"] == 1
