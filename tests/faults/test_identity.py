"""Each file names the snapshot it holds, and its tag's marker names it too: a swapped file is refused.

Two files of one shape from different snapshots have the same size and sound checksums, so
a tag whose file was replaced by another snapshot's (a mix across files: a stray copy, a
rename race) passed every check before. Now ``load``, ``verify`` and ``Client.restore``
compare the file's snapshot with the one its tag's marker lists, and refuse a mismatch
with an error naming both.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.storage.posix import PosixStorage
from datastates.protocol.errors import CommitError, CorruptCheckpointError, PathNotAllowedError, StorageError
from datastates.protocol.format import marker_name

from conftest import DaemonProc, save


def state(step: int) -> dict:
    return {"w": torch.full((4096,), float(step)), "step": step}


def test_a_file_swapped_for_another_snapshots_is_refused_by_load_verify_and_restore(
        shared_daemon: DaemonProc, shared_client: Client, tmp_path: Path) -> None:
    run = shared_daemon.root / "identity"
    for step in (1, 2):
        save(shared_client, state(step), run / f"step{step}" / "m.pt")
    marker = json.loads((run / "step1" / marker_name("step1")).read_text())
    assert marker["files"][0]["snapshot"], marker  # the marker names the snapshot of each file
    assert datastates.load(run / "step1" / "m.pt")["step"] == 1

    shutil.copyfile(run / "step2" / "m.pt", run / "step1" / "m.pt")  # same size, sound checksums, wrong step
    with pytest.raises(CorruptCheckpointError, match="replaced after the tag was committed") as err:
        datastates.load(run / "step1" / "m.pt")
    assert "step1" in str(err.value) and marker["files"][0]["snapshot"] in str(err.value)
    out = shared_daemon.ctl("verify", str(run / "step1"))
    assert out.returncode == 1 and "CORRUPT" in out.stdout and "replaced" in out.stdout, out.stdout
    with pytest.raises(CorruptCheckpointError):
        shared_client.restore(run, "m.pt", tag="step1")
    assert datastates.load(run / "step2" / "m.pt")["step"] == 2  # the file where it belongs still loads


def committed_then_durable(client: Client, run: Path) -> None:
    """step1 committed under ``run``, and step2's file durable in its place, its commit not asked yet."""
    save(client, state(1), run / "step1" / "m.pt")
    client.snapshot(state(2), run / "step2" / "m.pt")
    client.wait()
    deadline = time.monotonic() + 60
    while not (run / "step2" / "m.pt").exists():  # renamed into place once durable
        assert time.monotonic() < deadline, "the snapshot never became durable"
        time.sleep(0.02)


def test_a_file_replaced_by_another_writer_before_the_marker_fails_the_commit(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    """Another writer (a twin rank saving the same path on its own, ``fallback="local"``) puts a file of the same
    size at a snapshot's path before its tag's marker goes in: the commit fails, naming it, rather than committing a
    marker whose file holds another snapshot (the fault schedules, seed 190247)."""
    run = shared_daemon.root / "replaced-before-commit"
    committed_then_durable(shared_client, run)
    shutil.copyfile(run / "step1" / "m.pt", run / "step2" / "m.pt.other")
    (run / "step2" / "m.pt.other").replace(run / "step2" / "m.pt")  # same size, sound, another snapshot
    with pytest.raises(CommitError, match="another writer's"):
        shared_client.commit("step2").result(timeout=60)
    assert datastates.latest(run) == "step1"
    assert datastates.load(run / "step1" / "m.pt")["step"] == 1


def test_a_file_replaced_by_same_size_bytes_that_are_no_checkpoint_fails_the_commit(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    """As above, but the other writer's file is not a datastates checkpoint at all (another tool's file of the same
    size): it holds no snapshot, so it is not the one the marker lists, and the commit fails. It was committed: a
    tag ``latest`` names whose file no load can read."""
    run = shared_daemon.root / "replaced-by-garbage"
    committed_then_durable(shared_client, run)
    size = (run / "step2" / "m.pt").stat().st_size
    (run / "step2" / "m.pt.other").write_bytes(b"\0" * size)
    (run / "step2" / "m.pt.other").replace(run / "step2" / "m.pt")
    with pytest.raises(CommitError, match="another writer's"):
        shared_client.commit("step2").result(timeout=60)
    assert datastates.latest(run) == "step1"


def test_a_writer_never_renames_its_file_over_a_committed_one(shared_daemon: DaemonProc, shared_client: Client) -> None:
    """A save whose file is finished after another writer committed the same path (a trainer saving on its own
    while the daemon committed a twin's file) is refused at its rename: the committed file's bytes stay."""
    run = shared_daemon.root / "renamed-over"
    save(shared_client, state(1), run / "step1" / "m.pt")
    save(shared_client, state(2), run / "step2" / "m.pt")
    writer = PosixStorage(direct_io=False, owner="0123456789abcdef")
    with pytest.raises(PathNotAllowedError, match="another writer committed it"):
        writer.publish(str(run / "step1" / "m.pt"), (run / "step2" / "m.pt").read_bytes())
    assert datastates.load(run / "step1" / "m.pt")["step"] == 1
    assert sorted(p.name for p in (run / "step1").iterdir()) == sorted(["m.pt", marker_name("step1")])
    writer.publish(str(run / "step1" / "notes.txt"), b"a file no marker lists is replaced as before\n")
    writer.publish(str(run / "step1" / "notes.txt"), b"again\n")
    assert (run / "step1" / "notes.txt").read_bytes() == b"again\n"



def test_a_writer_never_moves_a_committed_tag_folder_made_at_its_path_meanwhile(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    """A file being written at ``run/step1`` while a save commits tag ``step1`` in folder ``run/step1/`` (admission
    saw no directory there; one appeared before the rename): its finish fails, as ``os.replace`` over a directory
    did, and the committed folder stays where it is. The writer's RENAME_EXCHANGE swapped the directory for the file,
    could not read it as a checkpoint, and its abort left the committed folder under a hidden temporary name (the
    tag gone from every listing) and the unfinished save's file at its path."""
    run = shared_daemon.root / "folder-at-path"
    writer = PosixStorage(direct_io=False, owner="0123456789abcdef")
    handle = writer.create(str(run / "step1"), "t1")
    writer.write(handle, 0, memoryview(b"x" * 4096))
    save(shared_client, state(1), run / "step1" / "m.pt")
    with pytest.raises((StorageError, PathNotAllowedError)):
        writer.finalize(handle)
    assert (run / "step1").is_dir(), sorted(p.name for p in run.iterdir())
    assert datastates.latest(run) == "step1"
    assert datastates.load(run / "step1" / "m.pt")["step"] == 1


def test_a_folder_lock_is_free_once_its_commit_is_done_though_a_child_shares_the_folders_descriptor(
        tmp_path: Path) -> None:
    """A commit's check and rename hold an flock on their folder (``folder_locked``); a trainer saving on its own
    that forks meanwhile (a DataLoader worker) shares that folder's open file description with its child. The lock
    must end with the commit, not with the child: the folder's next commit would wait for as long as it lives."""
    import fcntl
    import os
    import subprocess
    import sys

    from datastates.protocol.storage.posix import folder_locked

    folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(folder,))
    try:
        with folder_locked(folder):
            pass
        os.close(folder)
        again = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # the next commit there, while the child lives
        try:
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if the lock outlived the commit
        finally:
            os.close(again)
    finally:
        child.kill()
        child.wait()
