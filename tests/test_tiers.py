"""Storage tiers: a tag commits on the fast tier first, then is copied down and committed on each slower tier.

Real daemons on real folders: the copies are byte-identical and carry their own markers,
reads take the fastest tier that holds the tag committed, each tier keeps its own
``keep_last``, a tier that fails leaves the faster copy standing, and copies a killed
daemon left undone are finished by the next one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.descriptors import Ranks
from datastates.protocol.format import CommitMarker, marker_name

from conftest import DATASTATESCTL, DaemonProc, assert_state_equal, read_only, run_datastatesd, save, temp_files


def tiers_cfg(tmp: Path, fast_keep: int | None = None, slow_keep: int | None = None, node: str = "") -> dict[str, Any]:
    fast = {"name": "fast", "path": str(tmp / f"{node}fast"), "shared": False}
    slow = {"name": "pfs", "path": str(tmp / "pfs")}
    if fast_keep:
        fast["keep_last"] = fast_keep
    if slow_keep:
        slow["keep_last"] = slow_keep
    return {"storage": {"tiers": [fast, slow]}, "memory_restore": "none"}


def state(step: int, numel: int = 1 << 16) -> dict[str, Any]:
    torch.manual_seed(step)
    return {"w": torch.randn(numel), "h": torch.randn(8, 8).to(torch.bfloat16), "step": step, "note": f"step {step}"}


def settle(d: DaemonProc) -> dict[str, Any]:
    """The daemon's status once no snapshot, commit or tier transfer is pending, and no snapshot failed.

    What ``datastatesctl wait`` waits for and checks, read in-process: a ctl process costs
    seconds (it imports torch), and these tests settle many times.
    """
    deadline = time.monotonic() + 120  # a hang guard, as ``wait --timeout 120``
    while True:
        status = daemon_status(d.endpoint)
        if not status["pending"] and not status["commits_pending"] and not status["tier_transfers"]["pending"]:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"still pending after 120 s: {status['pending']} snapshot(s), {status['commits_pending']} "
                        f"commit(s), {status['tier_transfers']['pending']} tier transfer(s): "
                        f"{json.dumps(status['tier_transfers'])[:4000]}\nthe daemon's stacks:\n{d.stacks()}")
        time.sleep(0.05)
    failed = [s for s in status["snapshots"] if s["state"] == "failed"]
    assert not failed, failed
    return status


def tier_states(status: dict[str, Any], tag: str) -> dict[str, str]:
    rows = [e for e in status["tier_transfers"]["tags"] if e["tag"] == tag]
    assert rows, f"{tag} is not in status: {status['tier_transfers']}"
    return {c["tier"]: c["state"] for c in rows[-1]["tiers"]}


def test_a_tag_commits_on_the_fast_tier_then_on_every_tier(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(**tiers_cfg(tmp_path))
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2):
            committed = save(c, state(step), fast / f"step{step}" / "rank0.pt")
            assert committed.marker == str(fast / f"step{step}" / marker_name(f"step{step}"))  # COMMIT answers for the fast tier
    status = settle(d)
    for step in (1, 2):
        tag = f"step{step}"
        assert tier_states(status, tag) == {"fast": "committed", "pfs": "committed"}
        assert (fast / tag / "rank0.pt").read_bytes() == (slow / tag / "rank0.pt").read_bytes()
        assert_state_equal(state(step), datastates.load(slow / tag / "rank0.pt"))
        assert CommitMarker.read(str(slow / tag / marker_name(tag))).files == \
            CommitMarker.read(str(fast / tag / marker_name(tag))).files
    assert datastates.latest(slow) == "step2" and (slow / "latest").read_text() == "step2"
    row = next(e for e in status["tier_transfers"]["tags"] if e["tag"] == "step2")["tiers"][1]
    assert row["bytes_done"] == row["bytes_total"] == (slow / "step2" / "rank0.pt").stat().st_size
    assert temp_files(tmp_path / "pfs") == []
    shown = d.ctl("status")
    assert shown.returncode == 0 and "tiers: fast" in shown.stdout and "(node-local)" in shown.stdout
    listed = d.ctl("ls", str(fast))
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert sorted((r[0], r[5]) for r in rows if r[1] == "committed") == [
        ("step1", "fast"), ("step1", "pfs"), ("step2", "fast"), ("step2", "pfs")]


def test_reads_prefer_the_fastest_tier_and_fall_back_to_the_next(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(**tiers_cfg(tmp_path))
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
        settle(d)
        for root in (fast, slow):  # a root named on either tier maps to both
            got = c.restore(root, "rank0.pt")
            assert (got.tag, got.source, got.tier) == ("step1", "storage", "fast")
            assert_state_equal(state(1), got.state)
        (fast / "step1" / "rank0.pt").unlink()  # the node lost its local disk: the fast copy is no longer committed
        got = c.restore(fast, "rank0.pt")
        assert (got.tag, got.tier, got.path) == ("step1", "pfs", str(slow / "step1" / "rank0.pt"))
        assert_state_equal(state(1), got.state)


def test_each_tier_keeps_its_own_keep_last(start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(**tiers_cfg(tmp_path, fast_keep=1, slow_keep=2))
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    with Client(d.endpoint, timeout=60) as c:
        for step in range(1, 5):
            save(c, state(step), fast / f"step{step}" / "rank0.pt")
            settle(d)  # one copy at a time, so no tag is superseded and every one reaches the slow tier
    status = settle(d)
    assert sorted(p.name for p in fast.iterdir() if p.is_dir()) == ["step4"]
    assert sorted(p.name for p in slow.iterdir() if p.is_dir()) == ["step3", "step4"]
    assert tier_states(status, "step1") == {"fast": "pruned", "pfs": "pruned"}
    assert tier_states(status, "step3") == {"fast": "pruned", "pfs": "committed"}
    assert tier_states(status, "step4") == {"fast": "committed", "pfs": "committed"}
    for step in (3, 4):
        assert_state_equal(state(step), datastates.load(slow / f"step{step}" / "rank0.pt"))


def test_a_slow_tier_behind_copies_the_newest_and_never_a_mix(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(**tiers_cfg(tmp_path))
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    with Client(d.endpoint, timeout=60) as c:
        for step in range(1, 7):  # back to back: copies may fall behind and be superseded
            save(c, state(step, numel=1 << 20), fast / f"step{step}" / "rank0.pt")
    status = settle(d)
    assert datastates.latest(slow) == "step6"
    for step in range(1, 7):
        states = tier_states(status, f"step{step}")
        assert states["fast"] == "committed" and states["pfs"] in ("committed", "superseded"), states
        if states["pfs"] == "committed":
            assert_state_equal(state(step, numel=1 << 20), datastates.load(slow / f"step{step}" / "rank0.pt"))
        else:
            assert not (slow / f"step{step}" / marker_name(f"step{step}")).exists()


def test_a_failed_tier_copy_leaves_the_fast_copy_committed(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    slow_root = tmp_path / "pfs"
    (slow_root / "run").mkdir(parents=True)
    d = start_daemon(**tiers_cfg(tmp_path))
    fast, slow = tmp_path / "fast" / "run", slow_root / "run"
    with Client(d.endpoint, timeout=60) as c:
        with read_only(slow_root):
            save(c, state(1), fast / "step1" / "rank0.pt")  # the commit on the fast tier does not wait for the slow one
            status = settle(d)
        copy = next(e for e in status["tier_transfers"]["tags"] if e["tag"] == "step1")["tiers"][1]
        assert copy["state"] == "failed" and "read-only" in copy["error"], copy
        assert not (slow / "step1").exists() or not (slow / "step1" / marker_name("step1")).exists()
        got = c.restore(fast, "rank0.pt")
        assert (got.tag, got.tier) == ("step1", "fast")
        assert_state_equal(state(1), got.state)
        save(c, state(2), fast / "step2" / "rank0.pt")  # the tier is writable again: the next tag reaches it
    assert tier_states(settle(d), "step2") == {"fast": "committed", "pfs": "committed"}
    assert_state_equal(state(2), datastates.load(slow / "step2" / "rank0.pt"))


@pytest.mark.heavy
def test_a_copy_a_killed_daemon_left_undone_is_finished_by_the_next(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    cfg = tiers_cfg(tmp_path)
    d = start_daemon(**cfg)
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    big = state(1, numel=16 << 20)  # 64 MiB: the copy is usually still running when the daemon dies
    with Client(d.endpoint, timeout=60) as c:
        save(c, big, fast / "step1" / "rank0.pt")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
    again = start_daemon(**cfg)
    settle(again)
    assert datastates.latest(slow) == "step1"
    assert_state_equal(big, datastates.load(slow / "step1" / "rank0.pt"))
    assert temp_files(tmp_path / "pfs") == []


def test_shutdown_drains_the_tier_transfers(start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(**tiers_cfg(tmp_path))
    fast, slow = tmp_path / "fast" / "run", tmp_path / "pfs" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1, numel=8 << 20), fast / "step1" / "rank0.pt")
    out = d.ctl("shutdown")
    assert out.returncode == 0, out.stderr
    assert d.proc.wait(60) == 0
    assert datastates.latest(slow) == "step1"  # the job may end now: the slow tier has the last tag
    assert_state_equal(state(1, numel=8 << 20), datastates.load(slow / "step1" / "rank0.pt"))


def test_two_nodes_commit_per_node_on_local_tiers_and_together_on_the_shared_one(
        start_daemons: Callable[..., list[DaemonProc]], tmp_path: Path) -> None:
    nodes = start_daemons(*(tiers_cfg(tmp_path, node=f"node{n}-") for n in range(2)))
    local = [tmp_path / f"node{n}-fast" / "run" for n in range(2)]
    slow = tmp_path / "pfs" / "run"
    states = [state(10 + r) for r in range(4)]
    clients = [Client(nodes[r // 2].endpoint, timeout=60, ranks=Ranks(
        rank=r, local_rank=r % 2, world_size=4, local_world_size=2, node_rank=r // 2, num_nodes=2, job="j"))
        for r in range(4)]
    try:
        for r, c in enumerate(clients):
            c.snapshot(states[r], local[r // 2] / "global_step3" / f"rank{r}.pt")
            c.wait()
        for fut in [c.commit("global_step3") for c in clients]:
            fut.result(timeout=120)
        for d in nodes:
            settle(d)
        for n in range(2):  # each node's marker on its own disk lists its own files
            mine = CommitMarker.read(str(local[n] / "global_step3" / marker_name("global_step3")))
            assert sorted(f.path for f in mine.files) == [f"rank{r}.pt" for r in (2 * n, 2 * n + 1)]
            assert (mine.nodes, mine.node) == (2, n)
        shared = CommitMarker.read(str(slow / "global_step3" / marker_name("global_step3")))
        assert sorted(f.path for f in shared.files) == [f"rank{r}.pt" for r in range(4)] and shared.node == -1
        assert not list((slow / "global_step3").glob("datastates-done.*"))
        for r in range(4):
            got = clients[r].restore(local[r // 2], f"rank{r}.pt")
            assert (got.tag, got.tier) == ("global_step3", "fast")
            assert_state_equal(states[r], got.state)
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("tiers, message", [
    ([{"name": "a", "path": "/tmp/x"}, {"name": "a", "path": "/tmp/y"}], "names two tiers"),
    ([{"name": "a", "path": "/tmp/x"}, {"name": "b", "path": "/tmp/x/inner"}], "inside one another"),
    ([{"name": "a", "path": "relative"}], "must be an absolute path"),
    ([{"name": "a", "path": "/tmp/x", "shared": "yes"}], "is not true or false"),
    ([{"name": "a", "path": "/tmp/x", "keep_last": 0}], "not a positive integer"),
    ([{"name": "a", "path": "/tmp/x", "speed": 3}], "unknown key 'speed'"),
])
def test_bad_tiers_stop_the_daemon_with_a_clear_error(tmp_path: Path, tiers: list, message: str) -> None:
    config = tmp_path / "node.yaml"
    config.write_text(json.dumps({"endpoint": f"ipc://{tmp_path}/d.sock", "storage": {"tiers": tiers}}))
    out = run_datastatesd("--node-config", str(config))
    assert out.returncode == 2 and "storage.tiers[" in out.stderr and message in out.stderr, out.stderr


def test_ls_without_a_daemon_still_lists_the_folder(tmp_path: Path, start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(**tiers_cfg(tmp_path))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), fast / "step1" / "rank0.pt")
    settle(d)
    d.stop()
    out = subprocess.run([DATASTATESCTL, "--endpoint", d.endpoint, "--connect-timeout", "1", "ls", str(fast)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[5]) for r in rows] == [("step1", "committed", "-")]  # no daemon to name the tiers
    assert os.path.isdir(tmp_path / "pfs" / "run" / "step1")
