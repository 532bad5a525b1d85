"""CheckpointManager against a real daemon: save every K steps, keep the N newest, restore bitwise, report failures."""

from __future__ import annotations

import concurrent.futures
import copy
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import datastates
from datastates.client import Client
from datastates.integrations.manager import CheckpointManager
from datastates.protocol.errors import CommitError, InvalidRequestError
from datastates.protocol.format import DELETING_RE, marker_name

from conftest import DaemonProc, assert_state_equal, at_first_open
from resume_job import build

HANG_GUARD = 60
OTHER_RANKS = 7


def tag_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


@pytest.fixture
def root(shared_daemon: DaemonProc, request: pytest.FixtureRequest) -> Path:
    return shared_daemon.root / request.node.name


@pytest.fixture
def own_client(shared_daemon: DaemonProc) -> Iterator[Client]:
    """A client of its own, for a test whose failed snapshot must not reach the shared client's next wait()."""
    c = Client(shared_daemon.endpoint, timeout=60)
    yield c
    c.close()


def test_saves_every_k_and_keeps_the_newest(shared_client: Client, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """keep_last=2: each save prunes what the commits known so far leave beyond the two newest; close leaves exactly two.

    Every deletion under the root, every rename in it and its every fsync are watched: a
    tag's folder is first renamed to its deleting name, and the rename made durable, before
    any of the tag's files goes, so latest() never names a tag that is partly gone, even
    after a crash mid-prune (tests/faults/test_kill_prune.py kills one).
    """
    events: list[tuple[str, str]] = []
    real_unlink, real_fsync, real_rename = os.unlink, os.fsync, os.rename

    def tag_of(folder: str) -> str | None:
        deleting = DELETING_RE.fullmatch(os.path.basename(folder))
        return deleting.group(1) if deleting and os.path.dirname(folder) == str(root) else None

    def watched_unlink(path: Any, *, dir_fd: int | None = None) -> None:
        full = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else "", os.fspath(path))
        folder, name = os.path.split(full)
        tag = tag_of(folder)
        if tag is not None:
            assert not (root / tag).exists(), f"{name} of {tag} went while its folder was still in place"
            assert datastates.latest(root) != tag
            events.append((tag, name))
        real_unlink(path, dir_fd=dir_fd)

    def watched_rename(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
        if src_dir_fd is not None and os.readlink(f"/proc/self/fd/{src_dir_fd}") == str(root):
            events.append((os.fspath(src), "<renamed>"))
        real_rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    def watched_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(root):
            events.append(("<root>", "<fsync>"))
        real_fsync(fd)

    monkeypatch.setattr(os, "rename", watched_rename)
    monkeypatch.setattr(os, "fsync", watched_fsync)
    monkeypatch.setattr(os, "unlink", watched_unlink)
    job = build()
    manager = job.manager(shared_client, root, keep_last=2, every=3)
    saved = []
    for step in range(1, 14):
        job.step()
        fut = manager.maybe_save(step)
        if step % 3:
            assert fut is None
            continue
        tag = CheckpointManager.tag(step)
        assert fut.result(timeout=HANG_GUARD).tag == tag
        for r in range(1, OTHER_RANKS + 1):  # what the other ranks of a job would write beside it
            (root / tag / f"rank{r}.pt").write_bytes(b"x")
        saved.append(tag)
        assert tag_folders(root) == saved[-3:], "the two newest known committed, and the one just saved"
        assert datastates.latest(root) == tag
    manager.close()

    assert saved == ["step00000003", "step00000006", "step00000009", "step00000012"]
    assert tag_folders(root) == saved[-2:]
    assert datastates.latest(root) == "step00000012"
    files = sorted(f"rank{r}.pt" for r in range(OTHER_RANKS + 1))
    for tag in saved[:2]:
        renamed = events.index((tag, "<renamed>"))
        assert events[renamed + 1] == ("<root>", "<fsync>"), events[renamed:renamed + 2]
        seen = [(k, n) for k, (t, n) in enumerate(events) if t == tag and n != "<renamed>"]
        assert all(k > renamed for k, _ in seen) and sorted(n for _, n in seen) == sorted([*files, marker_name(tag)]), seen
    assert {t for t, _ in events} - {"<root>"} == set(saved[:2])

def test_restore_is_bitwise(shared_client: Client, root: Path) -> None:
    """The restored model, optimizer, scheduler, data order and RNGs are those of the saved step, to the bit."""
    job = build()
    extra = {"tokens": 0}
    manager = job.manager(shared_client, root, every=5, extra=extra)
    for step in range(1, 6):
        job.step()
        extra["tokens"] += 16
        manager.maybe_save(step)
    saved = copy.deepcopy({
        "model": job.model.state_dict(), "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(), "batches": job.batches.state_dict(), "extra": extra,
    })
    draws = (torch.rand(8), random.random(), np.random.rand(3), job.batches.next())
    job.batches.load_state_dict(saved["batches"])  # undo the batch drawn to look
    for _ in range(3):  # past the saved step, so restore has something to undo
        job.step()
    trained_on = copy.deepcopy(job.model.state_dict())
    manager.close()

    fresh = build(seed=1)
    fresh_extra: dict[str, Any] = {"tokens": -1}
    restored = fresh.manager(shared_client, root, every=5, extra=fresh_extra)
    assert restored.restore() == 5
    assert_state_equal(saved["model"], fresh.model.state_dict())
    assert_state_equal(saved["optimizer"], fresh.optimizer.state_dict())
    assert_state_equal(saved["scheduler"], fresh.scheduler.state_dict())
    assert_state_equal(saved["batches"], fresh.batches.state_dict())
    assert fresh_extra == {"tokens": 80}
    again = (torch.rand(8), random.random(), np.random.rand(3), fresh.batches.next())
    assert torch.equal(again[0], draws[0]) and again[1] == draws[1]
    assert np.array_equal(again[2], draws[2]) and torch.equal(again[3], draws[3])

    fresh.batches.load_state_dict(saved["batches"])
    for _ in range(3):
        fresh.step()
    assert_state_equal(trained_on, fresh.model.state_dict())  # and training goes on exactly as it did
    restored.close()


def test_restore_without_a_checkpoint_returns_none(shared_client: Client, root: Path) -> None:
    job = build()
    before = copy.deepcopy(job.model.state_dict())
    manager = job.manager(shared_client, root, every=5)
    assert manager.restore() is None
    assert_state_equal(before, job.model.state_dict())
    manager.close()


def test_a_failed_commit_is_raised_at_the_next_save_and_at_close(own_client: Client, root: Path) -> None:
    """A file where a tag's folder goes fails that tag's snapshot, so its commit; the committed tags survive."""
    root.mkdir()
    (root / "step00000002").write_text("in the way")
    job = build()
    manager = job.manager(own_client, root, keep_last=1, every=2)

    failed = manager.save(2)
    concurrent.futures.wait([failed], timeout=HANG_GUARD)  # a hang guard: the failure is known once it resolves
    assert isinstance(failed.exception(), CommitError)
    with pytest.raises(CommitError, match=r"checkpoint step00000002 under .* was not committed: .*Not a directory"):
        manager.save(4)
    assert manager.save(4).result(timeout=HANG_GUARD).tag == "step00000004"  # reported once; saving goes on

    (root / "step00000006").write_text("in the way")
    manager.save(6)
    with pytest.raises(CommitError, match="checkpoint step00000006"):
        manager.close()
    assert datastates.latest(root) == "step00000004", "keep_last=1 never deletes the only committed tag"
    assert tag_folders(root) == ["step00000004"]


def test_each_rank_writes_its_own_file_and_only_rank_0_prunes(shared_client: Client, root: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    job = build()
    manager = job.manager(shared_client, root, keep_last=1)
    assert manager.rank == 1
    for step in (1, 2, 3):
        job.step()
        manager.save(step).result(timeout=HANG_GUARD)
    manager.close()
    assert tag_folders(root) == ["step00000001", "step00000002", "step00000003"]
    for t in tag_folders(root):
        assert sorted(os.listdir(root / t)) == sorted([marker_name(t), "rank1.pt"])
    assert datastates.load(root / "step00000003" / "rank1.pt")["step"] == 3


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"every": 0}])
def test_bad_settings_are_refused(shared_client: Client, root: Path, bad: dict[str, int]) -> None:
    job = build()
    with pytest.raises(InvalidRequestError):
        job.manager(shared_client, root, **bad)


def test_restore_takes_only_its_own_tags(shared_client: Client, root: Path) -> None:
    """A newer committed tag of another tool under the same root (a DeepSpeed ``global_step1000``, with no
    ``rank0.pt``) is not the manager's: it restores its own newest tag, and leaves the other one alone."""
    job = build()
    manager = job.manager(shared_client, root, every=1)
    job.step()
    manager.save(1).result(timeout=HANG_GUARD)
    saved = copy.deepcopy(job.model.state_dict())
    other = root / "global_step1000" / "mp_rank_00_model_states.pt"
    handle = shared_client.snapshot({"w": torch.ones(4)}, other, tag="global_step1000")
    shared_client.wait()
    shared_client.commit(handle.tag).result(timeout=HANG_GUARD)
    assert datastates.latest(root) == "global_step1000"
    manager.close()

    fresh = build(seed=1)
    restored = fresh.manager(shared_client, root, every=1)
    assert restored.restore() == 1
    assert_state_equal(saved, fresh.model.state_dict())
    restored.close()
    assert tag_folders(root) == ["global_step1000", "step00000001"]


class NoState:
    """A plain iterable, as a torch DataLoader is: it has no state_dict()."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(3))


@pytest.mark.parametrize("part", ["data_loader", "scheduler"])
def test_a_part_without_state_is_refused_at_construction(shared_client: Client, root: Path, part: str) -> None:
    """Refused when the manager is made, naming the part, not at the first save many steps later."""
    job = build()
    parts = {"scheduler": job.scheduler, "data_loader": job.batches, part: NoState()}
    with pytest.raises(InvalidRequestError, match=rf"{part}: a NoState has no state_dict\(\) or load_state_dict\(\)"):
        CheckpointManager(shared_client, root, model=job.model, optimizer=job.optimizer, **parts)
    assert job.optimizer._optimizer_step_pre_hooks == {}, "no fence left on the optimizer"
    assert not root.exists(), "nothing written"


def test_a_tag_without_this_ranks_file_is_refused_by_name(shared_client: Client, root: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 of a job resumed from one that saved only rank 1's file is told so, not handed a FileNotFoundError."""
    monkeypatch.setenv("RANK", "1")
    job = build()
    manager = job.manager(shared_client, root)
    manager.save(1).result(timeout=HANG_GUARD)
    manager.close()
    monkeypatch.setenv("RANK", "0")
    rank0 = build().manager(shared_client, root)
    with pytest.raises(InvalidRequestError, match="step00000001 .* is committed without rank0.pt"):
        rank0.restore()
    rank0.close()


def test_restore_racing_another_jobs_prune_restores_the_newest_committed_tag(shared_client: Client, root: Path,
                                                                           shared_daemon: DaemonProc,
                                                                           tmp_path: Path) -> None:
    """Restore has listed step 3, the newest committed tag, and is opening its file, when another
    job runs to its end: resume_job.py resumes from step 3, commits step 4, and its keep_last=1 deletes steps 1 to 3.
    An audit hook on the open starts that job (a real process) at that very moment. restore then reads the newest
    committed tag, step 4, bitwise, instead of raising a raw FileNotFoundError (4 times in 1,578 racing restores)."""
    job = build()
    manager = job.manager(shared_client, root)
    for step in (1, 2, 3):
        job.step()
        manager.save(step)
    manager.close()
    out = tmp_path / "other.pt"
    other = at_first_open(os.path.join(root, "step00000003", "rank0.pt"),
                          [sys.executable, str(Path(__file__).with_name("resume_job.py")), shared_daemon.endpoint,
                           str(root), str(out), "--steps", "4", "--every", "1", "--keep-last", "1"])
    fresh = build(seed=1)
    step = fresh.manager(shared_client, root).restore()
    assert len(other) == 1 and other[0].returncode == 0, other
    assert other[0].stdout.splitlines() == ["resumed from step 3", "step 4"], other[0].stdout
    assert step == 4 and tag_folders(root) == ["step00000004"]
    saved = torch.load(out)
    assert_state_equal(saved["model"], fresh.model.state_dict())
    assert_state_equal(saved["optimizer"], fresh.optimizer.state_dict())
