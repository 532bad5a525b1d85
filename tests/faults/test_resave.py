"""I2, immutable: re-saving a committed tag writes a new version; the committed one never changes.

Saving the same paths again (Lightning's ``last.ckpt``, a rolling tag) used to rename new
files over committed ones one by one: a kill -9 between two renames, or a full disk on the
second file, left a tag that mixed two steps and still passed ``verify``. Now the new
version is written beside the tag's folder and switched in with one atomic exchange.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify
from datastates.protocol.errors import CommitError, DatastatesError, PathNotAllowedError
from datastates.protocol.format import marker_name
from datastates.protocol.tags import read_marker

from conftest import DaemonProc, rank_client, save

TRIALS = 20
"""With ``--long``; the default run (and ``make test``) does SHORT_TRIALS."""
SHORT_TRIALS = 4
SAME_FILE_ROUNDS = 20
"""Rounds of two clients saving one file at once; the race was lost in 3 of 5 runs."""
SLOW = {"host_memory": "4MiB", "chunk_size": "1MiB", "flush_threads": 1, "direct_io": False}


def files(step: int) -> dict[str, dict]:
    """a.pt, small, and b.pt, 64 MiB: every element holds the step, so any mix shows."""
    return {"a.pt": {"t": torch.full((1024,), float(step))}, "b.pt": {"t": torch.full((16 << 20,), float(step))}}


def steps_in(folder: Path, tag: str) -> set[float]:
    """The steps the committed files of ``tag`` hold, after a full verify of each; every file must be whole."""
    marker = read_marker(str(folder / marker_name(tag)))
    assert marker is not None, f"{folder}: {tag} is not committed"
    found = set()
    for f in marker.files:
        verify(folder / f.path)
        found |= set(datastates.load(folder / f.path)["t"].unique().tolist())
    return found


@pytest.mark.heavy
def test_a_kill_during_a_resave_leaves_one_whole_version(start_daemon: Callable[..., DaemonProc], long_runs: bool) -> None:
    rng = random.Random(7)
    d = start_daemon(**SLOW)
    tag_folder = d.root / "run" / "last"
    with Client(d.endpoint, timeout=60) as c:
        for name, state in files(1).items():
            c.snapshot(state, tag_folder / name, tag="last")
        c.commit("last").result(timeout=120)
    confirmed = 1
    for trial in range(TRIALS if long_runs else SHORT_TRIALS):
        step = trial + 2
        with Client(d.endpoint, timeout=60, liveness=1) as c:
            for name, state in files(step).items():
                c.snapshot(state, tag_folder / name, tag="last")
            fut: Future = c.commit("last")
            time.sleep(rng.uniform(0.05, 0.6))
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(30)
            try:
                fut.result(timeout=60)
                confirmed = step
            except DatastatesError:
                pass
        assert datastates.latest(d.root / "run") == "last"
        held = steps_in(tag_folder, "last")
        assert len(held) == 1, f"trial {trial}: tag 'last' mixes steps {held}"
        assert held.pop() >= confirmed, (trial, confirmed)
        d = start_daemon(**{**SLOW, "endpoint": d.endpoint})
    for _ in range(600):  # the last restart's recovery removes what the last kill left
        if json.loads(d.ctl("status", "--json").stdout)["daemon"]["leftovers_removed"] is not None:
            break
        time.sleep(0.1)
    assert not [p for p in (d.root / "run").iterdir() if p.name.startswith(".")], "a staging folder was left behind"


def test_a_resave_that_commits_replaces_the_version_whole(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    folder = d.root / "run" / "last"
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            for name, state in files(step).items():
                c.snapshot(state, folder / name, tag="last")
            done = c.commit("last").result(timeout=120)
            assert sorted(done.files) == sorted(str(folder / n) for n in files(step))
            assert steps_in(folder, "last") == {float(step)}
            assert (d.root / "run" / "latest").read_text() == "last"
        restored = c.restore(d.root / "run", "b.pt")
        assert restored is not None and torch.equal(restored.state["t"], files(3)["b.pt"]["t"])
    assert sorted(p.name for p in (d.root / "run").iterdir()) == ["last", "latest"]  # no version left beside it


def test_a_save_while_the_tags_commit_is_in_flight_never_replaces_the_file_that_commit_names(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The fault schedules found it (seed 10117): the tag had no marker yet when the next save was admitted, so
    that save was renamed over the file the landing marker named, and a failed commit of it left the swap for good."""
    d = start_daemon(**SLOW)
    folder = d.root / "run" / "last"
    with Client(d.endpoint, timeout=60) as c:
        for name, state in files(1).items():
            c.snapshot(state, folder / name, tag="last")
        first = c.commit("last")  # in flight: 64 MiB through a 4 MiB pool
        for name, state in files(2).items():
            c.snapshot(state, folder / name, tag="last")
        first.result(timeout=120)
        c.wait()  # step 2's files are whole, but their commit has not been asked for
        assert steps_in(folder, "last") == {1.0}  # the committed version, untouched
        c.commit("last").result(timeout=120)
        assert steps_in(folder, "last") == {2.0}


def test_a_save_while_a_new_version_is_being_committed_starts_a_version_of_its_own(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The fault schedules found it (seed 50071): the tag was committed, so its re-save was staged, and the next
    save, admitted while that staged version's commit was in flight, joined the same staging folder. After the
    switch, its own commit wrote a marker in a folder no reader looks in: the trainer was told step 3 was
    committed while the tag held step 2."""
    d = start_daemon(**SLOW)
    folder = d.root / "run" / "last"
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            for name, state in files(step).items():
                c.snapshot(state, folder / name, tag="last")
            if step == 1:
                c.commit("last").result(timeout=120)
            elif step == 2:
                second = c.commit("last")  # in flight while step 3 is admitted: 64 MiB through a 4 MiB pool
        second.result(timeout=120)
        c.wait()
        c.commit("last").result(timeout=120)
    assert steps_in(folder, "last") == {3.0}
    assert sorted(p.name for p in (d.root / "run").iterdir()) == ["last", "latest"]  # no version left beside it


def test_a_resave_never_deletes_another_tag_committed_in_the_same_folder(shared_daemon: DaemonProc,
                                                                        shared_client: Client) -> None:
    """The long schedule run found it (seed 60956): tag t2 saved into t0's folder, then t0 saved there twice. The
    second save switched t0's whole folder for its new version and deleted t2's committed file and marker."""
    folder = shared_daemon.root / "shared_folder" / "t0"
    save(shared_client, {"t": torch.full((100,), 2.0)}, folder / "model.pt", tag="t2")
    save(shared_client, {"t": torch.full((100,), 1.0)}, folder / "optim.pt", tag="t0")
    shared_client.snapshot({"t": torch.full((100,), 3.0)}, folder / "optim.pt", tag="t0")
    shared_client.wait()
    with pytest.raises(CommitError, match="also holds"):
        shared_client.commit("t0").result(timeout=60)
    assert torch.equal(datastates.load(folder / "model.pt")["t"], torch.full((100,), 2.0))  # t2, whole
    assert torch.equal(datastates.load(folder / "optim.pt")["t"], torch.full((100,), 1.0))  # t0's committed version
    assert (folder / "datastates-commit.t2.json").exists() and (folder / "datastates-commit.t0.json").exists()


def test_another_tags_file_and_another_clients_open_file_are_refused(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    shared = d.root / "k" / "m.pt"
    with Client(d.endpoint, timeout=60) as a, Client(d.endpoint, timeout=60) as b:
        save(a, {"t": torch.full((100,), 1.0)}, shared, tag="k1")
        a.snapshot({"t": torch.full((100,), 2.0)}, shared, tag="k2")
        with pytest.raises(PathNotAllowedError, match="committed tag"):
            a.wait()
        assert torch.equal(datastates.load(shared)["t"], torch.full((100,), 1.0))  # k1's bytes unchanged

        mine = d.root / "run" / "step1" / "m.pt"
        a.snapshot({"t": torch.full((100,), 3.0)}, mine)
        a.wait()
        b.snapshot({"t": torch.full((100,), 4.0)}, mine)
        with pytest.raises(PathNotAllowedError, match="is saving it"):
            b.wait()
        a.commit("step1").result(timeout=60)
        assert torch.equal(datastates.load(mine)["t"], torch.full((100,), 3.0))


def test_a_committed_tag_in_a_folder_with_a_long_name_is_saved_again(shared_daemon: DaemonProc,
                                                                       shared_client: Client) -> None:
    """The new version's staging folder has a short name of its own: a 250-byte folder name still re-saves."""
    folder = shared_daemon.root / "long" / ("f" * 250)
    for step in (1, 2):
        save(shared_client, {"t": torch.full((100,), float(step))}, folder / "m.pt", tag="keep")
        assert torch.equal(datastates.load(folder / "m.pt")["t"], torch.full((100,), float(step)))
    assert sorted(p.name for p in folder.parent.iterdir()) == ["f" * 250]


SAME_FILE_RANK = r"""
import sys, torch
from datastates.client import Client
from datastates.protocol.errors import DatastatesError
endpoint, root, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(endpoint, timeout=120) as c:
    for line in sys.stdin:  # "<round>": snapshot, wait, then report; "commit <round>": commit it, then report
        words = line.split()
        path = f"{root}/round{words[-1]}/step/m.pt"
        try:
            if words[0] == "commit":
                c.commit(f"step{rank}").result(timeout=120)
            else:
                c.snapshot({"t": torch.full((1 << 18,), 1000.0 * rank + int(words[0]))}, path, tag=f"step{rank}")
                c.wait()
            print("ok", flush=True)
        except DatastatesError as exc:
            print(f"refused {type(exc).__name__}", flush=True)
"""


def test_two_clients_that_snapshot_one_file_at_the_same_instant_are_never_both_told_it_committed(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Two trainers released together save the same path, each under a tag of its own (one tag would be refused by
    the tag's own one-writer check): one is refused, the other commits, and the file holds exactly the committed
    one's state (the one-writer check and the snapshot's registration are one step)."""
    d = start_daemon()
    ranks = [subprocess.Popen([sys.executable, "-c", SAME_FILE_RANK, d.endpoint, str(d.root), str(r)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]

    def step(line: str) -> list[str]:
        for p in ranks:  # both lines go out before either answer is read: the two requests race
            assert p.stdin is not None
            p.stdin.write(line + "\n")
            p.stdin.flush()
        return [p.stdout.readline().strip() for p in ranks if p.stdout is not None]

    try:
        for n in range(SAME_FILE_ROUNDS):
            saved = step(str(n))
            committed = [r for r, said in enumerate(step(f"commit {n}")) if said == "ok"]
            assert len(committed) == 1, f"round {n}: snapshots {saved}; told committed: ranks {committed}"
            assert saved[committed[0]] == "ok" and saved[1 - committed[0]].startswith("refused"), f"round {n}: {saved}"
            path = d.root / f"round{n}" / "step" / "m.pt"
            verify(path)
            got = datastates.load(path)["t"]
            expected = torch.full((1 << 18,), 1000.0 * committed[0] + n)
            assert torch.equal(got, expected), f"round {n}: the file holds {got.unique()[:4].tolist()}, not rank " \
                                               f"{committed[0]}'s {expected[0].item()}"
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_ranks_saving_a_committed_tag_again_make_one_new_version_whoever_commits_first(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Two ranks of a job on one node save a committed tag again, as DCP's ranks do a checkpoint_id: rank 1 commits
    first, then rank 0 (DCP's coordinator) saves one more file (its metadata) and commits. The ranks' files are one
    new version, switched in whole: the commit lists all three, each holding the new step."""
    d = start_daemon()
    tag = d.root / "run" / "ckpt"
    with rank_client(d, 0, 2, 2, 1) as c0, rank_client(d, 1, 2, 2, 1) as c1:
        for step in (1, 2):
            c0.snapshot({"w": torch.full((64,), float(step))}, tag / "rank0.pt")
            c1.snapshot({"w": torch.full((64,), float(step))}, tag / "rank1.pt")
            c1.wait()
            second = c1.commit("ckpt")
            c0.snapshot({"step": step}, tag / "metadata.pt")
            c0.wait()
            c0.commit("ckpt").result(timeout=120)
            second.result(timeout=120)
            assert sorted(f.path for f in read_marker(str(tag / marker_name("ckpt"))).files) == \
                ["metadata.pt", "rank0.pt", "rank1.pt"]
            assert datastates.load(tag / "metadata.pt")["step"] == step
            for r in (0, 1):
                assert torch.equal(datastates.load(tag / f"rank{r}.pt")["w"], torch.full((64,), float(step)))
    assert not [p.name for p in tag.parent.iterdir() if p.name.endswith(".dsgen")], "a staging folder was left"
