"""kill -9 of the daemon at random points of a flush: nothing committed is lost, nothing partial is trusted."""

from __future__ import annotations

import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.client.reader import verify
from datastates.protocol.errors import DaemonUnavailable, DatastatesError
from datastates.protocol.format import MEGATRON_TRACKER, TEMP_SUFFIX, TRACKER, marker_name
from datastates.protocol.tags import read_marker

from conftest import DaemonProc, assert_state_equal

TRIALS = 20
"""With ``--long``; the default run (and ``make test``) does SHORT_TRIALS."""
SHORT_TRIALS = 8


def state_for(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(3, 1 << 18, generator=g), "step": step}


def tag_of(step: int) -> str:
    """Megatron's tag names, so that both trackers (``latest`` and Megatron's iteration file) are written."""
    return f"iter_{step:07d}"


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


def assert_final_names_hold_whole_files(root: Path, trial: int) -> None:
    """Every checkpoint file under its final name passes ``verify``, committed or not: a partial file has a temp name."""
    for path in sorted(root.rglob("*.pt")):
        try:
            verify(path)
        except DatastatesError as exc:
            raise AssertionError(f"trial {trial}: a partial file is visible under its final name {path}: {exc}") from None


def assert_trackers_name_committed_tags(root: Path, trial: int) -> int:
    """``latest`` and Megatron's tracker, where present, name a tag whose marker is whole; how many were present."""
    named = {}
    if (root / TRACKER).exists():
        named[TRACKER] = (root / TRACKER).read_text()
    if (root / MEGATRON_TRACKER).exists():
        named[MEGATRON_TRACKER] = tag_of(int((root / MEGATRON_TRACKER).read_text()))
    for tracker, tag in named.items():
        assert read_marker(str(root / tag / marker_name(tag))) is not None, (
            f"trial {trial}: tracker {tracker} names {tag!r}, which has no whole commit marker")
    return len(named)


def test_kill9_mid_flush_leaves_no_partial_file_under_a_final_name(start_daemon: Callable[..., DaemonProc],
                                                                   long_runs: bool) -> None:
    """After each kill -9 and restart: the last confirmed commit (or a newer one) is latest() and loads bitwise,
    no file under a final name is partial, and no tracker names a tag ahead of its marker."""
    trials = TRIALS if long_runs else SHORT_TRIALS
    rng = random.Random(1234)
    slow = {"host_memory": "2MiB", "chunk_size": "1MiB", "flush_threads": 1, "direct_io": False}
    d = start_daemon(**slow)
    committed: list[int] = []  # steps whose commit() the client saw succeed
    removed = trackers_seen = 0
    step = 0
    for trial in range(trials):
        with Client(d.endpoint, timeout=30, liveness=1) as c:
            step += 1
            c.snapshot(state_for(step), d.root / tag_of(step) / "model_states.pt")
            fut: Future = c.commit(tag_of(step))
            time.sleep(rng.uniform(0, 0.15))
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(30)
            try:
                fut.result(timeout=60)
                committed.append(step)
            except DatastatesError:
                pass
        assert_final_names_hold_whole_files(d.root, trial)  # as the kill left them, before any recovery
        trackers_seen += assert_trackers_name_committed_tags(d.root, trial)
        d = start_daemon(**{**slow, "endpoint": d.endpoint})
        removed += recovered(d)["count"]
        assert not leftovers(d.root), f"trial {trial}: partial files left after restart: {leftovers(d.root)}"
        tag = datastates.latest(d.root)
        if committed:
            assert tag is not None and int(tag.removeprefix("iter_")) >= committed[-1], (trial, tag, committed)
        if tag is not None:
            n = int(tag.removeprefix("iter_"))
            assert_state_equal(state_for(n), datastates.load(d.root / tag / "model_states.pt"))
    print(f"{trials} kill -9 trials (steps committed: {committed}): {len(committed)} commits confirmed before the kill, {trials - len(committed)} killed mid-flush, {removed} partial files removed at restarts")
    assert committed, "no trial ever committed: the kills came too early to test anything"
    assert len(committed) < trials, "every flush finished before the kill: no kill hit a flush"
    assert trackers_seen, "no tracker was ever written: the tracker check tested nothing"


def test_kill9_while_a_file_is_half_written_leaves_nothing_partial_under_its_final_name(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The kill lands where status shows the file partly written: its bytes so far are under a temporary name,
    which the next daemon removes, and nothing is under the final name until the rename."""
    d = start_daemon(host_memory="2MiB", chunk_size="1MiB", flush_threads=1, direct_io=False)
    path = d.root / tag_of(1) / "model_states.pt"
    with Client(d.endpoint, timeout=30, liveness=1) as c:
        handle = c.snapshot({"w": torch.randn(16 << 20)}, path)  # 64 MiB through a 2 MiB pool: 1 MiB at a time
        c.commit(tag_of(1))
        admitted = handle.id  # blocks until the daemon has admitted it, so status lists it
        for _ in range(6000):  # a hang guard: until the first piece is written
            (job,) = [j for j in c.status()["snapshots"] if j["id"] == admitted]
            if job["flushed_bytes"] > 0 or job["state"] not in ("copying", "flushing"):
                break
            time.sleep(0.005)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
    assert job["state"] in ("copying", "flushing") and 0 < job["flushed_bytes"] < job["total_bytes"], job
    assert_final_names_hold_whole_files(d.root, 0)
    assert not path.exists() and leftovers(d.root), "the half-written file should lie under a temporary name"
    assert datastates.latest(d.root) is None


def test_a_daemon_restarted_on_the_same_endpoint_never_leaves_an_old_clients_wait_hanging(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The daemon is stopped before it answers a snapshot, then killed, and a new one starts on the same endpoint
    well within the client's liveness. The new one answers the old client's probes, but does not know it: wait()
    must raise DaemonUnavailable (the snapshot is given up), not wait for ever for replies only the dead one owed."""
    d = start_daemon()
    c = Client(d.endpoint, timeout=30, liveness=30.0)
    state = state_for(1)
    path = d.root / tag_of(1) / "model_states.pt"
    d.proc.send_signal(signal.SIGSTOP)
    c.snapshot(state, path)  # never answered: the daemon is stopped, then killed
    time.sleep(0.5)
    d.proc.kill()
    d.proc.wait(30)
    new = start_daemon(endpoint=d.endpoint)
    waiting = ThreadPoolExecutor(1).submit(c.wait)
    try:
        waiting.result(timeout=120)  # a hang guard: the probe at liveness / 2 (15 s) meets the new daemon
        raise AssertionError("wait() returned for a snapshot no daemon took")
    except DaemonUnavailable as exc:
        assert "no longer knows this client" in str(exc), exc
    except TimeoutError:
        raise AssertionError("wait() hung: the restarted daemon's answers to probes kept the old client waiting")
    c.close(timeout=5)
    assert not path.exists() and datastates.latest(d.root) is None
    with Client(new.endpoint, timeout=30) as again:  # a new client is served as usual
        again.snapshot(state, path)
        again.wait()
        again.commit(tag_of(1)).result(timeout=60)
    assert_state_equal(state, datastates.load(path))
