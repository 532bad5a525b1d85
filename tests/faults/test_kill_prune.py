"""A delete of a committed tag killed half way: nothing stays half-deleted for good.

Retention deletes a whole tag folder, which for a sharded job holds thousands of files: a
``kill -9`` of ``datastatesctl prune`` (or of the daemon applying ``keep_last``) lands in
the middle of it. Before, the marker went first and the files after, so the kill left a
folder of thousands of entries with no marker that ``ls`` showed as uncommitted and that no
prune would ever delete. Now the folder is renamed to its deleting name first (one step, a
tag that is either committed or gone to readers), and the next prune of its folder or the
next daemon start finishes the delete. The kill is timed by polling the folder's entries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status

from conftest import DATASTATESCTL, DaemonFactory, DaemonProc, assert_state_equal, save

PADDING = 20_000
"""Empty files added to the tag to be deleted, so that its delete takes long enough to be killed in the middle."""
TRIES = 5
"""Deletes to start before one is caught in the middle: a busy machine may let one finish between two polls."""


def state(step: int) -> dict:
    return {"w": torch.full((256,), float(step)), "step": step}


def commit(d: DaemonProc, step: int, padding: int = 0) -> None:
    """Commit tag ``step<step>``; then add ``padding`` empty files to its folder (its marker lists only its own)."""
    folder = d.root / f"step{step}"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(step), folder / "model.pt")
    for k in range(padding):
        os.close(os.open(folder / f"shard{k:06d}", os.O_CREAT | os.O_WRONLY, 0o644))


def step_folders(root: Path, step: int) -> list[Path]:
    """Tag ``step<step>``'s folder, under its own name or renamed to be deleted: whatever of it is left."""
    name = f"step{step}"
    return [p for p in root.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


def entries(root: Path, step: int) -> int:
    total = 0
    for folder in step_folders(root, step):
        try:
            total += len(os.listdir(folder))
        except FileNotFoundError:
            pass
    return total


def kill_mid_delete(root: Path, step: int, proc: subprocess.Popen) -> bool:
    """SIGKILL ``proc`` once it has deleted some, not all, of tag ``step<step>``'s entries; whether it was caught so."""
    while proc.poll() is None:
        left = entries(root, step)
        if 0 < left < PADDING - 100:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return entries(root, step) > 0
        time.sleep(0.001)
    return False


def assert_withdrawn(d: DaemonProc, step: int) -> None:
    """Half-deleted, tag ``step<step>`` is named by nothing: neither ``latest()`` nor ``ls``."""
    assert datastates.latest(d.root) == f"step{step + 1}"
    out = d.ctl("ls", str(d.root))
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert f"step{step}" not in rows, f"ls shows the half-deleted tag: {rows}"


def assert_gone(d: DaemonProc, step: int) -> None:
    assert step_folders(d.root, step) == [], f"left of tag step{step}: {step_folders(d.root, step)}"
    assert_state_equal(state(step + 1), datastates.load(d.root / f"step{step + 1}" / "model.pt"))


def recovered(d: DaemonProc) -> list[str]:
    """What the daemon removed at start, once it has (before it admits a snapshot)."""
    for _ in range(600):
        report = daemon_status(d.endpoint, timeout=30)["daemon"]["leftovers_removed"]
        if report is not None:
            return report["paths"]
        time.sleep(0.1)
    raise AssertionError("the daemon never finished its start-up recovery")


@pytest.mark.parametrize("finisher", ["prune", "daemon start"])
def test_a_killed_prune_leaves_nothing_half_deleted(finisher: str, start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    for attempt in range(TRIES):
        step = 2 * attempt + 1
        commit(d, step, PADDING)
        commit(d, step + 1)
        proc = subprocess.Popen([DATASTATESCTL, "prune", str(d.root), "--keep-last", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if kill_mid_delete(d.root, step, proc):
            break
    else:
        pytest.fail(f"none of {TRIES} prunes of {PADDING} files was caught in the middle")
    assert_withdrawn(d, step)
    if finisher == "prune":
        out = d.ctl("prune", str(d.root), "--keep-last", "1")
        assert out.returncode == 0, out.stderr
    else:
        d.stop()
        d = start_daemon()
        recovered(d)
    assert_gone(d, step)


@pytest.mark.heavy
def test_a_daemon_killed_in_its_retention_leaves_nothing_half_deleted(daemon_factory: DaemonFactory) -> None:
    for attempt in range(TRIES):
        d = daemon_factory.start(storage={"roots": [str(daemon_factory.tmp / "ckpt")], "keep_last": 1})
        step = 2 * attempt + 1
        commit(d, step, PADDING)
        c = Client(d.endpoint, timeout=60)
        c.snapshot(state(step + 1), d.root / f"step{step + 1}" / "model.pt")
        c.wait()
        c.commit(f"step{step + 1}")  # its keep_last deletes step<step> before the commit is answered
        caught = kill_mid_delete(d.root, step, d.proc)
        c.close()
        if caught:
            break
        d.stop()
    else:
        pytest.fail(f"none of {TRIES} retentions of {PADDING} files was caught in the middle")
    assert_withdrawn(d, step)
    d = daemon_factory.start()
    assert any(os.path.basename(p).startswith(f".step{step}.") for p in recovered(d))
    assert_gone(d, step)
