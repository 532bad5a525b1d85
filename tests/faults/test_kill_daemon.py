"""kill -9 of the daemon at random points of a flush: nothing committed is lost, nothing partial is trusted."""

from __future__ import annotations

import logging
import random
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.client.reader.stream import verify
from datastates.llm import Checkpointing
from datastates.protocol.errors import CommitError, DaemonUnavailable, DatastatesError
from datastates.protocol.format import MEGATRON_TRACKER, TEMP_SUFFIX, TRACKER, marker_name
from datastates.protocol.tags import read_marker

from conftest import DaemonProc, assert_state_equal

TRIALS = 20
"""With ``--long``; the default run (and ``make test``) does SHORT_TRIALS."""
SHORT_TRIALS = 4


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


@pytest.mark.heavy
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


def restarted_under(c: Client, d: DaemonProc, start_daemon: Callable[..., DaemonProc]) -> DaemonProc:
    """kill -9 of ``d`` and a new daemon on its endpoint, once ``c`` heard it: its idle heartbeat met a daemon that
    does not know it (no request of ``c`` was outstanding, so no wait() nor commit future met the loss)."""
    d.proc.kill()
    d.proc.wait(30)
    new = start_daemon(endpoint=d.endpoint, client_timeout=3)  # a heartbeat every 0.5 s
    for _ in range(2400):  # a hang guard only
        if c._conn.lost:
            return new
        time.sleep(0.05)
    raise AssertionError("the client never heard that the restarted daemon does not know it")


@pytest.mark.parametrize("whole", [False, True], ids=["part-saved-again", "all-saved-again"])
def test_a_tag_part_of_which_went_with_a_restarted_daemon_is_never_committed_with_the_rest_alone(
        start_daemon: Callable[..., DaemonProc], whole: bool) -> None:
    """a.pt of step 1 was copied (wait() returned), then the daemon was killed and a new
    one started on its endpoint. The next snapshot() says step 1 was lost (once, DaemonUnavailable), and connects
    again at the call after. Saving only b.pt again, the commit of step 1 fails (CommitError naming a.pt), instead of
    a marker listing b.pt alone beside an uncommitted a.pt; a save after that failure starts clean and commits both.
    Saving every file again (``whole``) commits at once."""
    d = start_daemon(client_timeout=3)
    tag, first, second = tag_of(1), {"a": torch.full((1000,), 1.0)}, {"b": torch.full((1000,), 2.0)}
    folder = d.root / tag
    with Client(d.endpoint, timeout=30, liveness=30.0) as c:
        c.snapshot(first, folder / "a.pt")
        c.wait()  # copied: a loss has nothing to abandon
        restarted_under(c, d, start_daemon)
        with pytest.raises(DaemonUnavailable, match=f"tag\\(s\\) \\['{tag}'\\] saved and not committed are lost"):
            c.snapshot(second, folder / "b.pt")
        if whole:
            c.snapshot(first, folder / "a.pt")
        c.snapshot(second, folder / "b.pt")  # connects again, as a new client
        c.wait()
        if not whole:
            with pytest.raises(CommitError, match="part of it was lost with the daemon.*a.pt"):
                c.commit(tag).result(timeout=60)
            assert not (folder / marker_name(tag)).exists() and datastates.latest(d.root) is None
            c.snapshot(first, folder / "a.pt")
            c.snapshot(second, folder / "b.pt")
            c.wait()
        committed = c.commit(tag).result(timeout=60)
    assert sorted(Path(f).name for f in committed.files) == ["a.pt", "b.pt"]
    assert [f.path for f in read_marker(folder / marker_name(tag)).files] == ["a.pt", "b.pt"]
    assert datastates.latest(d.root) == tag
    assert_state_equal(first, datastates.load(folder / "a.pt"))
    assert_state_equal(second, datastates.load(folder / "b.pt"))


def test_the_datastates_llm_engine_never_commits_a_checkpoint_part_of_which_went_with_a_restarted_daemon(
        start_daemon: Callable[..., DaemonProc], caplog: pytest.LogCaptureFixture) -> None:
    """Through ``datastates.CheckpointEngine``: global_step1's a.pt was copied, the daemon restarted, then DeepSpeed
    saves b.pt and d.pt of the same checkpoint. The job is told once (a warning naming global_step1 lost, no
    exception), global_step1 is never committed without a.pt, and global_step2 commits."""
    d = start_daemon(client_timeout=3)
    engine = Checkpointing(runtime_config={"endpoint": d.endpoint, "liveness": 30.0}, rank=0)
    try:
        engine.save({"a": torch.full((1000,), 1.0)}, d.root / "global_step1" / "a.pt")
        engine.wait()
        restarted_under(engine.client, d, start_daemon)
        with caplog.at_level(logging.WARNING, logger="datastates.integrations"):
            engine.save({"b": torch.full((1000,), 2.0)}, d.root / "global_step1" / "b.pt")  # meets the loss
            engine.save({"d": torch.full((1000,), 4.0)}, d.root / "global_step1" / "d.pt")  # connected again
            state = {"c": torch.full((1000,), 3.0)}
            engine.save(state, d.root / "global_step2" / "c.pt")
            engine.wait(True)
        told = [r.getMessage() for r in caplog.records if "global_step1" in r.getMessage()]
        assert len(told) == 1 and "lost" in told[0], told
    finally:
        engine.shutdown()
    assert not (d.root / "global_step1" / marker_name("global_step1")).exists()
    assert datastates.latest(d.root) == "global_step2"
    assert_state_equal(state, datastates.load(d.root / "global_step2" / "c.pt"))


@pytest.mark.parametrize("found_at", ["save", "fence"])
def test_a_fixed_folder_saved_again_after_its_checkpoint_went_with_a_restarted_daemon_commits_again(
        start_daemon: Callable[..., DaemonProc], caplog: pytest.LogCaptureFixture, found_at: str) -> None:
    """DataStates-LLM's fixed folder: every checkpoint is tag ``current``. The checkpoint that met the loss (at its
    next save, or at the optimizer step's fence, DeepSpeed's usual place) is not saved further (the job is told
    once), but the next checkpoint, the same files of the same tag, is saved and committed whole: a lost tag's skip
    ends where its next checkpoint begins, not only at another tag."""
    d = start_daemon(client_timeout=3)
    engine = Checkpointing(runtime_config={"endpoint": d.endpoint, "liveness": 30.0}, rank=0)
    folder = d.root / "current"
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    try:
        engine.save({"a": torch.full((1000,), 1.0)}, folder / "a.pt")
        if found_at == "fence":
            engine.save({"b": torch.full((1000,), 1.0)}, folder / "b.pt")
        engine.wait()
        restarted_under(engine.client, d, start_daemon)
        with caplog.at_level(logging.WARNING, logger="datastates.integrations"):
            if found_at == "save":
                engine.save({"b": torch.full((1000,), 1.0)}, folder / "b.pt")  # meets the loss: the rest is skipped
            param.grad = torch.ones(4)
            optimizer.step()  # the fence (the engine's step pre-hook)
            a, b = {"a": torch.full((1000,), 2.0)}, {"b": torch.full((1000,), 2.0)}
            engine.save(a, folder / "a.pt")  # the next checkpoint, the same files again
            engine.save(b, folder / "b.pt")
            engine.wait(True)
        told = [r.getMessage() for r in caplog.records if "current" in r.getMessage()]
        assert len(told) == 1 and "lost" in told[0], told
    finally:
        engine.shutdown()
    assert datastates.latest(d.root) == "current"
    assert_state_equal(a, datastates.load(folder / "a.pt"))
    assert_state_equal(b, datastates.load(folder / "b.pt"))
