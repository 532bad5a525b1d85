"""Retention and the daemon's guards in run folders others share, and against a prune's stale listing.

A run folder of mode 2775 (setgid, a project's group) or one made under umask 002 is one
readers may not trust (``untrusted_folder``), but the daemon's own guards must still see the
markers in it: they refuse a save over a committed file and keep the files a marker lists.
Retention must never delete a tag folder that holds another tag's marker, nor a tag
committed again after the prune listed it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify
from datastates.protocol.errors import PathNotAllowedError
from datastates.protocol.retention import delete_tag
from datastates.protocol.tags import committed_tags

from conftest import DATASTATESCTL, DaemonProc, assert_state_equal, at_first_open, save


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test."""
    return shared_daemon_folder


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


def folders(root: Path) -> list[str]:
    """The folders of ``root``, hidden ones (a delete's, a staging version's) included."""
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def step_state(step: int) -> dict:
    return {"w": torch.arange(32.0) * step, "step": step}


def test_keep_last_never_deletes_a_folder_holding_a_newer_tags_marker(start_daemon: Callable[..., DaemonProc],
                                                                      tmp_path: Path) -> None:
    """step1, step2, then "best" saved into step1's folder (its marker there), then step3: the daemon's keep_last=2
    keeps step1's folder, since "best" would go with it. Before, step1 went whole and "best" with it."""
    d = start_daemon(storage={"roots": [str(tmp_path / "ckpt")], "keep_last": 2})
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2):
            save(c, step_state(step), d.root / f"step{step}" / "rank0.pt")
        save(c, step_state(100), d.root / "step1" / "best.pt", tag="best")
        save(c, step_state(3), d.root / "step3" / "rank0.pt")
    assert (d.root / "step1" / "datastates-commit.best.json").exists(), sorted(os.listdir(d.root))
    assert_state_equal(step_state(100), datastates.load(d.root / "step1" / "best.pt"))
    verify(str(d.root / "step1" / "best.pt"))
    assert "holds the commit marker(s) ['datastates-commit.best.json']" in d.log_text()


def test_prune_never_deletes_a_folder_holding_a_newer_tags_marker(daemon: DaemonProc) -> None:
    """The same through ``datastatesctl prune --keep-last 1``: "best", the newest committed tag, stands."""
    d = daemon
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2):
            save(c, step_state(step), d.root / f"step{step}" / "rank0.pt")
        save(c, step_state(100), d.root / "step1" / "best.pt", tag="best")
    dry = d.ctl("prune", str(d.root), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and "step1" not in dry.stdout, dry.stdout + dry.stderr
    out = d.ctl("prune", str(d.root), "--keep-last", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "datastates-commit.best.json" in out.stderr  # said why step1 stays
    assert datastates.latest(d.root) == "best"
    assert_state_equal(step_state(100), datastates.load(d.root / "step1" / "best.pt"))
    assert_state_equal(step_state(1), datastates.load(d.root / "step1" / "rank0.pt"))


def test_a_tag_committed_again_after_the_listing_is_not_deleted(daemon: DaemonProc) -> None:
    """A prune lists step1, then the daemon commits a new version of step1 (the trainer is told "committed"),
    then step3, then the prune deletes from its listing: the new version stands, and so does the listing's folder
    name. Before, the new version was renamed away and deleted. (step3 moves the tracker on: a tracker naming step1
    would keep it for a reason of its own.)"""
    d = daemon
    path = d.root / "step1" / "rank0.pt"
    with Client(d.endpoint, timeout=60) as c:
        save(c, step_state(1), path)
        save(c, step_state(2), d.root / "step2" / "rank0.pt")
        listed = [t for t in committed_tags(str(d.root), own_folder=True) if t.tag == "step1"]
        save(c, step_state(11), path)  # a new version of step1, switched in whole
        save(c, step_state(3), d.root / "step3" / "rank0.pt")
    assert [t.tag for t in listed] == ["step1"]
    deleted = delete_tag(listed[0], str(d.root))
    assert_state_equal(step_state(11), datastates.load(path))
    verify(str(path))
    assert folders(d.root) == ["step1", "step2", "step3"]
    assert deleted is False


def test_a_stale_listing_or_a_second_prune_skips_a_tag_gone_already(daemon: DaemonProc) -> None:
    """Two prunes at once: the second's listing names a folder the first deleted; it skips it and deletes the rest.
    Before, its rename raised FileNotFoundError and the whole prune stopped (``datastatesctl prune`` exit 2)."""
    d = daemon
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            save(c, step_state(step), d.root / f"step{step}" / "rank0.pt")
    stale = committed_tags(str(d.root), own_folder=True)
    out = d.ctl("prune", str(d.root), "--keep-last", "2")  # the first prune: step1 goes
    assert out.returncode == 0, out.stdout + out.stderr
    assert [delete_tag(t, str(d.root)) for t in stale[2:]] == [False]  # the second's step1: gone already
    assert folders(d.root) == ["step2", "step3"]


@pytest.mark.parametrize("other", ["mid-delete", "done"])
def test_a_prune_never_renames_back_a_folder_another_prune_is_deleting(other: str, daemon: DaemonProc) -> None:
    """Two prunes at once (the daemon's keep_last after two overlapping commits, found by ``bench/soak.py
    --overlap 1``): the first renames step1 to its deleting name; before it looks inside, the second, finishing
    what it finds under such a name, has deleted step1's marker (``mid-delete``) or the whole folder (``done``).
    The first leaves the folder to it, and the next prune finishes what is left. Before, the first renamed the
    folder back: a step1 without its marker, an uncommitted folder no prune ever deletes (one more on every such
    race, for good), or it raised FileNotFoundError and the whole prune stopped."""
    d = daemon
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            save(c, step_state(step), d.root / f"step{step}" / "rank0.pt")
    stale = committed_tags(str(d.root), own_folder=True)
    marker = re.compile(re.escape(str(d.root)) + r"/\.step1\.[0-9a-f]+\.dsdel/datastates-commit\.step1\.json")
    ran = at_first_open(marker, (lambda path: ["rm", path]) if other == "mid-delete"
                        else [DATASTATESCTL, "prune", str(d.root), "--keep-last", "2"])
    assert [delete_tag(t, str(d.root)) for t in stale[2:]] == [False]
    assert len(ran) == 1 and ran[0].returncode == 0, ran
    out = d.ctl("prune", str(d.root), "--keep-last", "2")  # finishes what a delete left under its deleting name
    assert out.returncode == 0, out.stdout + out.stderr
    assert folders(d.root) == ["step2", "step3"]
