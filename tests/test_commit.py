"""Commit: a tag is committed once all its files are durable, and latest() trusts nothing but whole markers."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import CommitError, SnapshotFailedError
from datastates.protocol.format import MEGATRON_TRACKER, TRACKER, marker_name

from conftest import DaemonProc, assert_state_equal, read_only, save, sh, temp_files


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder


def shard(seed: int, mb: int = 2) -> dict[str, Any]:
    """A few MiB of state, so several snapshots are still being copied while the next ones arrive."""
    g = torch.Generator().manual_seed(seed)
    return {"weights": torch.randn(mb << 18, generator=g), "bias": torch.randn(17, generator=g), "seed": seed}


def test_several_tags_in_flight(client: Client, daemon: DaemonProc) -> None:
    """Two files of one tag and a file of another, all snapshotted before any wait, commit separately and all load."""
    a, b = daemon.root / "global_step10", daemon.root / "global_step20"
    states = {
        a / "mp_rank_00_model_states.pt": shard(1),
        a / "zero_pp_rank_0_mp_rank_00_optim_states.pt": shard(2),
        b / "mp_rank_00_model_states.pt": shard(3),
    }
    handles = [client.snapshot(state, path) for path, state in states.items()]
    assert [h.tag for h in handles] == ["global_step10", "global_step10", "global_step20"]
    assert len({h.id for h in handles}) == 3

    fa, fb = client.commit("global_step10"), client.commit("global_step20")  # both pending at once
    ca, cb = fa.result(timeout=120), fb.result(timeout=120)

    assert sorted(ca.files) == sorted(str(p) for p in list(states)[:2])
    assert cb.files == [str(list(states)[2])]
    assert ca.marker == str(a / marker_name("global_step10")) and cb.marker == str(b / marker_name("global_step20"))
    listed = json.loads(Path(ca.marker).read_text())["files"]
    assert {f["path"]: f["size"] for f in listed} == {p.name: p.stat().st_size for p in list(states)[:2]}
    for path, state in states.items():
        assert_state_equal(state, datastates.load(path))
    assert datastates.latest(daemon.root) in {"global_step10", "global_step20"}

    on_disk = sorted(str(p.relative_to(daemon.root)) for p in daemon.root.rglob("*") if p.is_file())
    assert on_disk == sorted([
        "global_step10/datastates-commit.global_step10.json",
        "global_step10/mp_rank_00_model_states.pt",
        "global_step10/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "global_step20/datastates-commit.global_step20.json",
        "global_step20/mp_rank_00_model_states.pt",
        "latest",
    ]), "no temporary files or anything else left behind"
    assert (daemon.root / "latest").read_text() == "global_step20"  # the newer tag, whichever commit finished last
    assert temp_files(daemon.root) == []


def test_latest_is_the_newest_whole_commit(client: Client, daemon: DaemonProc) -> None:
    """latest() skips an uncommitted tag, a marker whose file has the wrong size, and a torn or garbage marker."""
    root = daemon.root
    step = lambda n: root / f"global_step{n}" / "mp_rank_00_model_states.pt"  # noqa: E731
    assert datastates.latest(root) is None

    save(client, shard(10, 1), step(10))
    assert datastates.latest(root) == "global_step10"
    save(client, shard(20, 1), step(20))
    assert datastates.latest(root) == "global_step20", "the newer commit wins"

    client.snapshot(shard(30, 1), step(30))  # durable, but never committed
    assert daemon.ctl("wait", "--timeout", "60").returncode == 0
    assert step(30).is_file()
    assert datastates.latest(root) == "global_step20"

    save(client, shard(40, 1), step(40))
    with step(40).open("ab") as f:
        f.write(b"\0")  # the file no longer has the size its marker lists
    assert datastates.latest(root) == "global_step20"

    committed = save(client, shard(50, 1), step(50))
    Path(committed.marker).write_bytes(b"\x00\xffthis is not json{")
    assert datastates.latest(root) == "global_step20"

    committed = save(client, shard(60, 1), step(60))
    whole = Path(committed.marker).read_bytes()
    Path(committed.marker).write_bytes(whole[: len(whole) // 2])  # a torn write
    assert datastates.latest(root) == "global_step20"

    save(client, shard(70, 1), step(70))
    assert datastates.latest(root) == "global_step70", "a good commit after the bad ones is found again"
    assert temp_files(root) == []


def test_commit_without_snapshots_is_refused(client: Client, daemon: DaemonProc) -> None:
    """Committing a tag with nothing snapshotted for it, or committing it twice, is a CommitError, not an empty marker."""
    with pytest.raises(CommitError, match="global_step99"):
        client.commit("global_step99").result(timeout=60)

    save(client, shard(1, 1), daemon.root / "global_step1" / "model_states.pt")
    with pytest.raises(CommitError, match="global_step1"):
        client.commit("global_step1").result(timeout=60)

    assert list(daemon.root.rglob(marker_name("global_step99"))) == []
    assert datastates.latest(daemon.root) == "global_step1"


def test_the_newest_snapshot_of_a_path_wins(client: Client, daemon: DaemonProc) -> None:
    """Two snapshots of one path in flight: the file ends up holding the later one, and is listed once."""
    path = daemon.root / "global_step5" / "model_states.pt"
    first, second = shard(1, 4), shard(2, 1)
    client.snapshot(first, path)
    client.snapshot(second, path)
    committed = client.commit("global_step5").result(timeout=120)

    assert committed.files == [str(path)]
    assert_state_equal(second, datastates.load(path))
    assert temp_files(daemon.root) == []


def test_explicit_tag_names_the_marker(client: Client, daemon: DaemonProc) -> None:
    """A tag other than the folder name is what the marker and latest() use."""
    path = daemon.root / "checkpoints" / "model.pt"
    committed = save(client, shard(3, 1), path, tag="epoch3+step1200")
    assert Path(committed.marker) == path.parent / marker_name("epoch3+step1200")
    assert datastates.latest(daemon.root) == "epoch3+step1200"


def unwritable_path(root: Path) -> Path:
    """A path inside the root that passes the path check but cannot be created: its 'folder' is a file."""
    (root / "not_a_folder").write_text("a file where the trainer expected a folder")
    return root / "not_a_folder" / "model_states.pt"


@pytest.mark.own_daemon  # counts the daemon's snapshots, and leaves a failed one in its status
def test_failed_snapshot_is_reported_everywhere(client: Client, daemon: DaemonProc) -> None:
    """An unwritable snapshot fails loudly: wait(), commit(), status and `ctl wait` name the file; no marker appears."""
    path = unwritable_path(daemon.root)
    client.snapshot(shard(1, 1), path, tag="global_step8")

    with pytest.raises(SnapshotFailedError, match="not_a_folder"):
        client.wait()
    with pytest.raises(CommitError, match="global_step8"):
        client.commit("global_step8").result(timeout=60)
    (snap,) = json.loads(daemon.ctl("status", "--json").stdout)["snapshots"]
    assert snap["state"] == "failed" and "not_a_folder" in snap["error"]
    run = daemon.ctl("wait", "--timeout", "60")  # a job script learns of it too
    assert run.returncode == 1 and str(path) in run.stderr

    assert datastates.latest(daemon.root) is None
    assert list(daemon.root.rglob("datastates-commit.*")) == []
    assert temp_files(daemon.root) == []


@pytest.mark.own_daemon  # a failed snapshot stays in the daemon's status, and its `ctl wait`
def test_trainer_can_checkpoint_again_after_a_failed_snapshot(client: Client, daemon: DaemonProc) -> None:
    """One failed checkpoint (a full disk, a bad path) must not poison the client: the next snapshot, wait and commit succeed."""
    client.snapshot(shard(1, 1), unwritable_path(daemon.root), tag="global_step8")
    with pytest.raises(SnapshotFailedError):
        client.wait()

    state = shard(2, 1)
    path = daemon.root / "global_step9" / "model_states.pt"
    client.snapshot(state, path)
    client.wait()  # only this snapshot is outstanding; the failure was reported already
    client.commit("global_step9").result(timeout=120)
    assert_state_equal(state, datastates.load(path))
    assert datastates.latest(daemon.root) == "global_step9"


def snapshot_entry(client: Client, path: Path) -> dict[str, Any]:
    """The daemon's status entry of the one snapshot of ``path``."""
    (entry,) = [s for s in client.status()["snapshots"] if s["path"] == str(path)]
    return entry


def wait_durable(client: Client, path: Path) -> None:
    """Poll status until the snapshot of ``path`` is durable (a hang guard, not a timed assertion)."""
    for _ in range(2400):
        entry = snapshot_entry(client, path)
        if entry["state"] == "durable":
            return
        assert entry["state"] != "failed", entry
        time.sleep(0.05)
    raise AssertionError(f"the snapshot of {path} never became durable")


def test_the_trackers_never_name_a_tag_whose_marker_failed(client: Client, daemon: DaemonProc) -> None:
    """The marker commits a tag, so the trackers follow it: when the marker cannot be written (the tag folder is
    read-only) but the trackers could be (their folder is not), both trackers still name the previous tag."""
    root = daemon.root
    save(client, shard(1, 1), root / "iter_0000001" / "model_states.pt")
    path = root / "iter_0000002" / "model_states.pt"
    client.snapshot(shard(2, 1), path)
    client.wait()
    wait_durable(client, path)
    with read_only(path.parent):
        with pytest.raises(CommitError, match="read-only file system") as not_committed:
            client.commit("iter_0000002").result(timeout=60)
        assert marker_name("iter_0000002") in not_committed.value.message
        named = ((root / TRACKER).read_text(), (root / MEGATRON_TRACKER).read_text())
        assert named == ("iter_0000001", "1"), f"the trackers name a tag whose marker failed: {named}"
        assert datastates.latest(root) == "iter_0000001"
    client.commit("iter_0000002").result(timeout=60)  # writable again: the retry commits, trackers follow
    assert (root / TRACKER).read_text() == "iter_0000002"
    assert (root / MEGATRON_TRACKER).read_text() == "2"
    assert temp_files(root) == []


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[None]:
    """``folder`` a tmpfs of ``size`` while inside: files in it run out of space, files in its parent do not."""
    folder.mkdir(parents=True)
    mounted = sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield
    finally:
        if sh("umount", folder).returncode != 0:
            assert sh("umount", "-l", folder).returncode == 0, f"cannot unmount the tmpfs on {folder}"


def test_commit_fails_when_a_file_cannot_become_durable_though_its_marker_could(
        client: Client, daemon: DaemonProc) -> None:
    """COMMIT waits for every file to be durable: one that runs out of space fails the commit, naming the file
    and the cause, though the tag folder, where the marker goes, has room; no marker appears."""
    root = daemon.root
    save(client, shard(1, 1), root / "step1" / "model_states.pt")
    shards = root / "step2" / "shards"  # the tag folder is step2: the marker goes there, outside the tmpfs
    with small_tmpfs(shards, "1m"):
        path = shards / "model_states.pt"
        client.snapshot(shard(2, 8), path, tag="step2")  # 8 MiB into 1 MiB
        with pytest.raises(CommitError) as not_committed:
            client.commit("step2").result(timeout=120)  # asked before the write fails: the daemon must wait for it
        assert "disk full" in not_committed.value.message and str(path) in not_committed.value.message
        entry = snapshot_entry(client, path)
        assert entry["state"] == "failed" and "disk full" in entry["error"]
        assert temp_files(root) == [] and not path.exists()
    assert not (root / "step2" / marker_name("step2")).exists()
    assert datastates.latest(root) == "step1"
    assert (root / TRACKER).read_text() == "step1"


def test_a_commit_after_a_trainers_local_commits_in_the_same_run_is_the_latest(
        client: Client, daemon: DaemonProc, tmp_path: Path) -> None:
    """The fault schedules found it (seed 40161): a trainer that lost the daemon commits on its own in the same run
    folder; a later commit through the daemon must still be the newest there. The daemon read the run's sequence
    once and counted on from it, so its commit ranked below the trainer's and ``latest()`` named an older tag."""
    run = daemon.root / "mixed"
    save(client, shard(1), run / "t0" / "m.pt", tag="t0")
    nowhere = f"ipc://{tmp_path}/no-daemon.sock"
    with Client(nowhere, timeout=2, fallback="local") as local:  # no daemon answers: it saves in this process
        assert local.local
        for step in (2, 3):
            save(local, shard(step), run / f"l{step}" / "m.pt", tag=f"l{step}")
    assert datastates.latest(run) == "l3"
    save(client, shard(4), run / "t4" / "m.pt", tag="t4")
    assert datastates.latest(run) == "t4"
    assert_state_equal(shard(4), datastates.load(run / "t4" / "m.pt"))
