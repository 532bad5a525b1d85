"""kill -9 of the daemon at random points of a flush: nothing committed is lost, nothing partial is trusted."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.errors import DatastatesError
from datastates.protocol.format import TEMP_SUFFIX

from conftest import DaemonProc, assert_state_equal

TRIALS = 20
"""With ``--long``; the default run (and ``make test``) does SHORT_TRIALS."""
SHORT_TRIALS = 8


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 1 << 18, generator=g), "step": step}


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"*{TEMP_SUFFIX}")]


def recovered(d: DaemonProc) -> dict[str, Any]:
    """The restarted daemon's report of the partial files it removed (it does so before admitting).

    Read in-process (what ``datastatesctl status --json`` prints): a ctl process per poll costs seconds.
    """
    for _ in range(600):
        report = daemon_status(d.endpoint, timeout=30)["daemon"]["leftovers_removed"]
        if report is not None:
            return report
        time.sleep(0.1)
    raise AssertionError("the daemon never finished its start-up recovery")


def test_kill9_mid_flush_keeps_the_last_committed_tag(start_daemon: Callable[..., DaemonProc], long_runs: bool) -> None:
    trials = TRIALS if long_runs else SHORT_TRIALS
    rng = random.Random(1234)
    slow = {"host_memory": "2MiB", "chunk_size": "1MiB", "flush_threads": 1, "direct_io": False}
    d = start_daemon(**slow)
    committed: list[int] = []  # steps whose commit() the client saw succeed
    removed = 0
    step = 0
    for trial in range(trials):
        with Client(d.endpoint, timeout=30, liveness=1) as c:
            step += 1
            c.snapshot(state_for(step), d.root / f"step{step}" / "model_states.pt")
            fut: Future = c.commit(f"step{step}")
            time.sleep(rng.uniform(0, 0.15))
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(30)
            try:
                fut.result(timeout=60)
                committed.append(step)
            except DatastatesError:
                pass
        d = start_daemon(**{**slow, "endpoint": d.endpoint})
        removed += recovered(d)["count"]
        assert not leftovers(d.root), f"trial {trial}: partial files left after restart: {leftovers(d.root)}"
        tag = datastates.latest(d.root)
        if committed:
            assert tag is not None and int(tag.removeprefix("step")) >= committed[-1], (trial, tag, committed)
        if tag is not None:
            n = int(tag.removeprefix("step"))
            assert_state_equal(state_for(n), datastates.load(d.root / tag / "model_states.pt"))
    print(f"{trials} kill -9 trials (steps committed: {committed}): {len(committed)} commits confirmed before the kill, {trials - len(committed)} killed mid-flush, {removed} partial files removed at restarts")
    assert committed, "no trial ever committed: the kills came too early to test anything"
    assert len(committed) < trials, "every flush finished before the kill: no kill hit a flush"
