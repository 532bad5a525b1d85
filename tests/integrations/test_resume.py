"""kill -9 a training job at a random step, restart it from latest(), and it ends bitwise where an uninterrupted run does.

The job (resume_job.py) trains through a real datastatesd, with a CheckpointManager saving
every 5 steps. The daemon stays up across the kill, as it does on a node whose trainer
crashed, so whatever it had admitted and been asked to commit still lands. The restart
must resume from a committed step (not from scratch) and reach the same final model and
optimizer state, bit for bit, as the run that was never interrupted.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import datastates

from conftest import DaemonProc, assert_state_equal

JOB = Path(__file__).with_name("resume_job.py")
STEPS, EVERY, KEEP_LAST = 40, 5, 2
HANG_GUARD = 120


def start_job(d: DaemonProc, root: Path, out: Path, lockstep: bool = False) -> subprocess.Popen:
    """The job in a process group of its own, so that ``kill -9`` takes the whole job."""
    cmd = [sys.executable, str(JOB), d.endpoint, str(root), str(out), "--steps", str(STEPS), "--every", str(EVERY),
           "--keep-last", str(KEEP_LAST)] + (["--lockstep"] if lockstep else [])
    return subprocess.Popen(cmd, stdin=subprocess.PIPE if lockstep else subprocess.DEVNULL, stdout=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen) -> list[str]:
    out, _ = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 0, f"the job failed with {proc.returncode}:\n{out}"
    return out.splitlines()


def tag_step(tag: str | None) -> int:
    return int(tag.removeprefix("step")) if tag else 0


def tag_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def uninterrupted(shared_daemon: DaemonProc) -> dict[str, Any]:
    """Params A: the job run start to finish."""
    root, out = shared_daemon.root / "uninterrupted", shared_daemon.root / "uninterrupted.pt"
    lines = finish(start_job(shared_daemon, root, out))
    assert lines[0] == "fresh start" and lines[1:] == [f"step {s}" for s in range(1, STEPS + 1)]
    assert tag_folders(root) == ["step00000035", "step00000040"], "keep_last=2 leaves the two newest tags"
    return torch.load(out)


def kill_at(d: DaemonProc, root: Path, out: Path, step: int) -> int:
    """Run the job until it has printed ``step``, then kill -9 it while it goes on; the committed step it had by then."""
    proc = start_job(d, root, out, lockstep=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.strip() == f"step {step}":
                break
            if line.startswith("step "):
                proc.stdin.write("\n")
                proc.stdin.flush()
        else:
            pytest.fail(f"the job exited with {proc.wait()} before step {step}")
        deadline = time.monotonic() + HANG_GUARD  # a hang guard: the daemon commits step 5 long before this
        while datastates.latest(root) is None:
            assert time.monotonic() < deadline, "no tag was committed before the kill"
            time.sleep(0.05)
        committed = tag_step(datastates.latest(root))
        proc.stdin.write("\n")  # let it run on: the kill lands in the middle of the next step
        proc.stdin.flush()
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(HANG_GUARD) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return committed


KILL_STEPS = [random.Random(seed).randint(EVERY + 1, STEPS - EVERY - 1) for seed in (0, 1)] + [4 * EVERY]
"""Two seeded random steps, and one right after a save, while that tag's copy and commit are in flight."""


@pytest.mark.parametrize("step", KILL_STEPS)
def test_kill_9_then_resume_is_bitwise(shared_daemon: DaemonProc, uninterrupted: dict[str, Any], step: int) -> None:
    root, out = shared_daemon.root / f"killed-at-{step}", shared_daemon.root / f"killed-at-{step}.pt"
    committed = kill_at(shared_daemon, root, out, step)
    assert not out.exists()

    lines = finish(start_job(shared_daemon, root, out))
    assert lines[0].startswith("resumed from step "), lines[0]
    resumed = int(lines[0].removeprefix("resumed from step "))
    assert resumed % EVERY == 0 and committed <= resumed <= step + 1, (committed, resumed, step)
    assert resumed > 0, "the restart started from scratch"
    assert lines[1:] == [f"step {s}" for s in range(resumed + 1, STEPS + 1)]

    final = torch.load(out)
    assert_state_equal(uninterrupted, final)  # every tensor: same dtype, shape, stride and bytes
    assert tag_folders(root) == ["step00000035", "step00000040"]
