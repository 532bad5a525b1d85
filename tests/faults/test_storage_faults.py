"""The storage under a root fails: the disk fills up, or the file system turns read-only.

The root is a small ext4 file system, loop-mounted from an image, so the real write path
(O_DIRECT pwrite, fsync, rename, directory fsync) meets real ENOSPC and EROFS errors.
What must hold after each failure:

- the caller gets the error where the docs say (``wait()`` for a snapshot that failed
  before the daemon held all of it, ``commit()`` always), naming the cause and the path;
- ``status`` lists the snapshot as failed, with that error;
- the daemon stays up and keeps serving: the next tag commits and loads bitwise;
- the last committed tag is still ``latest()``, loads bitwise and passes ``datastatesctl verify``;
- nothing half-written is left: no temp files, and the space of the failed file is free again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import CommitError, DatastatesError, SnapshotFailedError, StorageError
from datastates.protocol.format import TRACKER

from conftest import (DATASTATESCTL, DaemonFactory, DaemonProc, assert_state_equal, read_only, removed_but_mapped, save, sh,
                      temp_files)

MiB = 1 << 20
FS_SIZE = 48 * MiB
SLACK = 1 * MiB
"""What ext4 may keep for itself after a failed file (a new tag folder, metadata): not the file's blocks."""


def unmount_all(mnt: Path) -> None:
    """Pop every mount stacked on ``mnt`` (a bind on top of the loop mount); lazily if one is busy."""
    for _ in range(4):
        if not os.path.ismount(mnt):
            return
        if sh("umount", mnt).returncode != 0:
            sh("umount", "-l", mnt)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 48 MiB ext4 file system, loop-mounted; yields a folder in it to use as a root."""
    if os.geteuid() != 0:
        pytest.skip("loop-mounting an ext4 image needs root")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with img.open("wb") as f:
        f.truncate(FS_SIZE)
    made = sh("mkfs.ext4", "-q", "-F", "-m", "0", img)  # -m 0: no blocks reserved for root, which we are
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed: {made.stderr.strip()}")
    mounted = sh("mount", "-o", "loop", img, mnt)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image here (no loop devices?): {mounted.stderr.strip()}")
    root = mnt / "ckpt"
    root.mkdir()
    try:
        yield root
    finally:
        unmount_all(mnt)


@pytest.fixture
def fs_daemon(small_fs: Path, tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    """Factory: a daemon whose only root is on the small file system (stopped, and waited for, before it is unmounted)."""
    factory = DaemonFactory(tmp_path)

    def start(**overrides: Any) -> DaemonProc:
        return factory.start(storage={"roots": [str(small_fs)]}, **overrides)

    yield start
    factory.stop_all()


@contextlib.contextmanager
def full(folder: Path) -> Iterator[None]:
    """The file system of ``folder`` full while inside: a filler file beside the root takes every free block."""
    filler = folder.parent / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for size in (MiB, 64 << 10, 4096, 1024, 1):  # smaller and smaller, down to the last partial block
            buf = bytes(size)
            while True:
                try:
                    os.write(fd, buf)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        os.fsync(fd)
        assert free_bytes(folder) == 0
        yield
    finally:
        os.close(fd)
        filler.unlink()


def free_bytes(path: Path) -> int:
    os.sync()  # ext4 settles freed blocks with its journal: measure after it did
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def state_of(step: int, nbytes: int) -> dict[str, Any]:
    """Random float32 tensors of ``nbytes`` in all, in 4 MiB pieces, and a few Python objects."""
    g = torch.Generator().manual_seed(step)
    n = nbytes // (4 * MiB)
    return {"model": {f"w{i}": torch.randn(MiB, generator=g) for i in range(n)}, "step": step, "lr": 3e-4}


def copy_of(state: dict[str, Any]) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "step": state["step"], "lr": state["lr"]}


def assert_intact(root: Path, tag: str, expected: dict[str, Any]) -> None:
    """``tag`` loads bitwise and ``datastatesctl verify`` finds every file of it sound."""
    assert_state_equal(expected, datastates.load(root / tag / "model_states.pt"))
    out = subprocess.run([DATASTATESCTL, "verify", "--root", str(root), tag],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def status_of(c: Client, path: Path) -> dict[str, Any]:
    """The daemon's status entry of the one snapshot of ``path``: what ``datastatesctl status`` shows."""
    (entry,) = [s for s in c.status()["snapshots"] if s["path"] == str(path)]
    return entry


def wait_durable(c: Client, path: Path) -> None:
    """Poll status until the snapshot of ``path`` is durable (a hang guard, not a timed assertion)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        entry = status_of(c, path)
        if entry["state"] == "durable":
            return
        assert entry["state"] != "failed", entry
        time.sleep(0.05)
    raise AssertionError(f"the snapshot of {path} never became durable")


@pytest.mark.parametrize("direct_io", [True, False], ids=["o_direct", "buffered"])
def test_disk_full_fails_the_tag_and_keeps_the_last_one(
    fs_daemon: Callable[..., DaemonProc], small_fs: Path, direct_io: bool
) -> None:
    """A tag larger than the free space fails cleanly: the error says disk full, its blocks are given back."""
    root = small_fs
    # One 4 MiB chunk: without a replica a piece is copied only after the previous one is written, so
    # wait() reports the failure; step 2 is copied into its replica's pages, which do not wait for writes.
    d = fs_daemon(host_memory="4MiB", chunk_size="4MiB", direct_io=direct_io)
    first = state_of(1, 8 * MiB)
    expected = copy_of(first)
    with Client(d.endpoint, timeout=60) as c:
        save(c, state_of(0, 4 * MiB), root / "step0" / "model_states.pt")
        save(c, first, root / "step1" / "model_states.pt")  # step 0's replica is now a spare: step 2 fills it in place
        before = free_bytes(root)
        big_bytes = (before // MiB + 16) * MiB // (4 * MiB) * (4 * MiB)
        assert big_bytes > before + 8 * MiB
        big = root / "step2" / "model_states.pt"
        c.snapshot(state_of(2, big_bytes), big)
        fut = c.commit("step2")
        try:  # copied into its replica's pages, the snapshot may be whole in memory before the disk fills
            c.wait()
        except SnapshotFailedError as failed:
            assert "disk full" in failed.message and str(big) in failed.message
        with pytest.raises(CommitError) as not_committed:
            fut.result(timeout=120)
        assert "disk full" in not_committed.value.message and str(big) in not_committed.value.message
        entry = status_of(c, big)
        assert entry["state"] == "failed" and "disk full" in entry["error"] and str(big) in entry["error"]
        removed = removed_but_mapped(d, c.status()["replicas"]["folder"])
        assert not removed, f"the failed snapshot's replica pages are still mapped, outside the budget: {removed}"

    assert d.proc.poll() is None, d.log_text()
    assert temp_files(root) == []
    assert not big.exists()
    after = free_bytes(root)
    assert after >= before - SLACK, f"{before - after} bytes still taken after the failed snapshot"
    assert datastates.latest(root) == "step1"
    assert_intact(root, "step1", expected)
    waited = d.ctl("wait", "--timeout", "60")
    assert waited.returncode == 1 and "disk full" in waited.stdout + waited.stderr

    third = state_of(3, 4 * MiB)
    with Client(d.endpoint, timeout=60) as c:  # a new client: the daemon serves on
        save(c, third, root / "step3" / "model_states.pt")
    assert datastates.latest(root) == "step3"
    assert_state_equal(copy_of(third), datastates.load(root / "step3" / "model_states.pt"))
    assert_intact(root, "step1", expected)
    assert "Traceback" not in d.log_text()


def test_read_only_root_fails_the_tag_until_it_is_writable(
    fs_daemon: Callable[..., DaemonProc], small_fs: Path
) -> None:
    """A root that turns read-only fails the snapshot at once (wait and commit say so); rw again, it commits."""
    root = small_fs
    d = fs_daemon()
    first = state_of(1, 8 * MiB)
    expected = copy_of(first)
    with Client(d.endpoint, timeout=60) as c:
        save(c, first, root / "step1" / "model_states.pt")
        ro = root / "step2" / "model_states.pt"
        with read_only(root):
            c.snapshot(state_of(2, 4 * MiB), ro)
            fut = c.commit("step2")
            with pytest.raises(SnapshotFailedError) as failed:
                c.wait()
            assert "read-only file system" in failed.value.message and str(ro) in failed.value.message
            with pytest.raises(CommitError) as not_committed:
                fut.result(timeout=120)
            assert "read-only file system" in not_committed.value.message and str(ro) in not_committed.value.message
            entry = status_of(c, ro)
            assert entry["state"] == "failed" and "read-only file system" in entry["error"]
            assert d.proc.poll() is None, d.log_text()
            assert datastates.latest(root) == "step1"
        third = state_of(3, 4 * MiB)
        save(c, third, root / "step3" / "model_states.pt")  # writable again: the same client commits
    assert datastates.latest(root) == "step3"
    assert_state_equal(copy_of(third), datastates.load(root / "step3" / "model_states.pt"))
    assert_intact(root, "step1", expected)
    assert temp_files(root) == [] and not ro.exists()


@pytest.mark.parametrize("fault, cause", [(read_only, "read-only file system"), (full, "disk full")],
                         ids=["read-only", "disk-full"])
def test_a_marker_that_cannot_be_written_fails_the_commit_and_a_retry_succeeds(
    fs_daemon: Callable[..., DaemonProc], small_fs: Path,
    fault: Callable[[Path], contextlib.AbstractContextManager[None]], cause: str,
) -> None:
    """The files are durable but the marker cannot be written (read-only root, or no block left): the commit
    fails, the tag is not taken as committed, and once the fault is gone a retry of the same commit goes through."""
    root = small_fs
    d = fs_daemon()
    first = state_of(1, 4 * MiB)
    with Client(d.endpoint, timeout=60) as c:
        save(c, first, root / "step1" / "model_states.pt")
        second = state_of(2, 4 * MiB)
        path = root / "step2" / "model_states.pt"
        c.snapshot(second, path)
        c.wait()
        wait_durable(c, path)
        with fault(root):
            with pytest.raises(CommitError) as not_committed:
                c.commit("step2").result(timeout=120)
            msg = not_committed.value.message
            assert cause in msg and "datastates-commit.step2" in msg and str(root / "step2") in msg
            assert datastates.latest(root) == "step1"
            assert temp_files(root) == []
        committed = c.commit("step2").result(timeout=120)  # the tag stays open after a marker failure
    assert committed.tag == "step2" and committed.files == [str(path)]
    assert datastates.latest(root) == "step2"
    assert_state_equal(copy_of(second), datastates.load(path))
    assert temp_files(root) == []
    assert d.proc.poll() is None, d.log_text()


def test_disk_full_during_a_resave_keeps_the_committed_version_whole(
        fs_daemon: Callable[..., DaemonProc], small_fs: Path) -> None:
    """I2: re-saving tag ``last`` runs out of space on its second file; ``last`` stays the old version, whole."""
    root = small_fs
    d = fs_daemon(host_memory="4MiB", chunk_size="4MiB")
    folder = root / "run" / "last"
    old = {"a.pt": state_of(1, 4 * MiB), "b.pt": state_of(11, 8 * MiB)}
    expected = {name: copy_of(s) for name, s in old.items()}
    with Client(d.endpoint, timeout=60) as c:
        for name, state in old.items():
            c.snapshot(state, folder / name, tag="last")
        c.commit("last").result(timeout=120)
        big_bytes = (free_bytes(root) // MiB + 16) * MiB // (4 * MiB) * (4 * MiB)
        c.snapshot(state_of(2, 4 * MiB), folder / "a.pt", tag="last")  # fits, and is durable first
        c.snapshot(state_of(12, big_bytes), folder / "b.pt", tag="last")  # does not fit
        fut = c.commit("last")
        try:  # fails, unless its copies all landed before a write failed: with a spare replica (allocated ahead
            c.wait()  # once b.pt's first replica was committed) the copies fill its pages, and no pool chunk paces them
        except SnapshotFailedError as exc:
            assert "disk full" in exc.message, exc.message
        with pytest.raises(CommitError, match="disk full"):
            fut.result(timeout=120)
        assert datastates.latest(root / "run") == "last"
        for name, state in expected.items():  # the committed version, both files, untouched
            assert_state_equal(state, datastates.load(folder / name))
        out = subprocess.run([DATASTATESCTL, "verify", "--root", str(root / "run"), "last"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr

        new = {"a.pt": state_of(3, 4 * MiB), "b.pt": state_of(13, 4 * MiB)}  # once it fits, the re-save commits
        for name, state in new.items():
            c.snapshot(state, folder / name, tag="last")
        c.commit("last").result(timeout=120)
        for name, state in new.items():
            assert_state_equal(copy_of(state), datastates.load(folder / name))
    assert sorted(p.name for p in (root / "run").iterdir()) == ["last", "latest"]
    assert temp_files(root) == []


def test_a_resave_refused_for_a_full_disk_at_admission_fails_its_whole_tag(
        fs_daemon: Callable[..., DaemonProc], small_fs: Path) -> None:
    """I1 (the fault schedules, seed 92834): a re-save's first file was refused at admission because its version's
    folder could not be made (disk full), as an internal error the commit did not hear of; the disk then had room
    for the second file, and the tag was committed with that one file alone. Now the refusal fails the tag."""
    root = small_fs
    d = fs_daemon(host_memory="4MiB", chunk_size="4MiB")
    folder = root / "run" / "last"
    old = {"a.pt": state_of(1, MiB), "b.pt": state_of(11, MiB)}
    expected = {name: copy_of(s) for name, s in old.items()}
    with Client(d.endpoint, timeout=60) as c:
        for name, state in old.items():
            c.snapshot(state, folder / name, tag="last")
        c.commit("last").result(timeout=120)
        with full(root):
            c.snapshot(state_of(2, MiB), folder / "a.pt", tag="last")  # its new version's folder cannot be made
            with pytest.raises(StorageError, match="disk full"):
                c.wait()
        c.snapshot(state_of(12, MiB), folder / "b.pt", tag="last")  # room again: this one is admitted
        with pytest.raises(CommitError, match="refused"):
            c.commit("last").result(timeout=120)
        for name, state in expected.items():  # the committed version, both files, untouched
            assert_state_equal(state, datastates.load(folder / name))
        marker = json.loads((folder / "datastates-commit.last.json").read_text())
        assert sorted(f["path"] for f in marker["files"]) == ["a.pt", "b.pt"]


def test_the_local_fallback_removes_its_staging_folder_when_a_resave_meets_a_full_disk(
        small_fs: Path, tmp_path: Path) -> None:
    """I5 (the fault schedules, seed 20069): the trainer lives on, so no daemon would remove a staging folder of
    its local saver; a re-save of a committed tag that runs out of space must remove its own, at once."""
    root = small_fs
    folder = root / "run" / "last"
    with Client(f"ipc://{tmp_path}/no-daemon.sock", timeout=2, fallback="local") as c:  # no daemon: saves itself
        assert c.local
        first = state_of(1, 4 * MiB)
        save(c, first, folder / "a.pt", tag="last")
        too_big = state_of(2, (free_bytes(root) // MiB + 16) * MiB)
        with pytest.raises(DatastatesError, match="disk full"):
            c.snapshot(too_big, folder / "a.pt", tag="last")  # a local save is written before snapshot() returns
        assert [p.name for p in (root / "run").iterdir() if p.name.startswith(".")] == []
        assert datastates.latest(root / "run") == "last"
        assert_state_equal(copy_of(first), datastates.load(folder / "a.pt"))
        again = state_of(3, 4 * MiB)
        save(c, again, folder / "a.pt", tag="last")  # once it fits, the re-save commits
    assert_state_equal(copy_of(again), datastates.load(folder / "a.pt"))
    assert sorted(p.name for p in (root / "run").iterdir()) == ["last", TRACKER]  # no version left beside it
    assert (root / "run" / TRACKER).read_text() == "last"  # a local commit names its tag in the tracker too
    assert temp_files(root) == []
