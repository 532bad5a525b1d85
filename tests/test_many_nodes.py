"""Many ranks on a daemon and many daemons in a job, at a small size: a rank killed mid-snapshot, and
what a late node costs the shared file system's metadata server.

The figures at full size (8 ranks per daemon, 64 daemons) are bench/many_ranks.py's and
bench/many_daemons.py's; here the behaviour is checked with real daemons and ranks.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import daemon_status
from datastates.protocol.errors import CommitError
from datastates.protocol.format import marker_name

from conftest import DaemonProc, rank_client

RANK2 = (
    "import sys, time, torch\n"
    "from datastates.client import Client\n"
    "from datastates.protocol.descriptors import Ranks\n"
    "endpoint, path, tag, mib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])\n"
    "c = Client(endpoint, timeout=60, ranks=Ranks(rank=2, local_rank=2, world_size=3, local_world_size=3, job='j1'))\n"
    "c.snapshot({'w': torch.full((mib << 18,), 2.0), 'tag': tag}, path, tag=tag)\n"
    "print('SENT', flush=True)\n"
    "if mib > 1:\n"
    "    time.sleep(600)  # killed mid-copy\n"
    "c.wait()\n"
    "c.commit(tag).result(timeout=120)\n"
    "c.close()\n"
    "print('COMMITTED', flush=True)\n"
)
"""Rank 2 of a job of 3 on one node, in a process of its own: a state of ``mib`` MiB of 2.0, saved as ``tag``; a
large one is left mid-copy (the test kills the process), a small one is committed."""


def rank2(d: DaemonProc, tag: str, mib: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RANK2, d.endpoint, str(d.root / tag / "rank2.pt"), tag, str(mib)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "SENT"
    return proc


def copying(d: DaemonProc, tag: str) -> dict:
    """The daemon's status of the snapshot of ``tag`` once it is admitted (a hang guard, not a timing check)."""
    for _ in range(1200):
        jobs = [j for j in daemon_status(d.endpoint)["snapshots"] if j["tag"] == tag]
        if jobs:
            return jobs[0]
        time.sleep(0.01)
    raise AssertionError(f"no snapshot of {tag} was admitted in 12 s")


def test_a_rank_killed_mid_snapshot_fails_the_tag_for_every_rank_and_its_restart_commits_the_next(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Three ranks on one daemon; rank 2 is killed with kill -9 while the daemon still copies its 512 MiB: the other
    ranks' commits of the tag fail (rank 2 never committed it, and its memory went mid-copy), nothing of the tag is
    committed, and once rank 2 is back (a new process, as torchrun's restart) the job's next tag commits whole."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1, client_timeout=1.5)
    with rank_client(d, 0, 3, 3, 1) as c0, rank_client(d, 1, 3, 3, 1) as c1:
        victim = rank2(d, "global_step1", 512)
        job = copying(d, "global_step1")
        victim.kill()
        victim.wait(30)
        assert job["copied_bytes"] < job["total_bytes"], "rank 2's snapshot was copied before the kill: not mid-copy"
        futures = []
        for r, c in ((0, c0), (1, c1)):
            c.snapshot({"w": torch.full((1000,), float(r))}, d.root / "global_step1" / f"rank{r}.pt", tag="global_step1")
            c.wait()
            futures.append(c.commit("global_step1"))
        for fut in futures:
            with pytest.raises(CommitError, match="global_step1"):
                fut.result(timeout=120)
        assert not (d.root / "global_step1" / marker_name("global_step1")).exists()
        assert datastates.latest(d.root) is None

        back = rank2(d, "global_step2", 1)
        for r, c in ((0, c0), (1, c1)):
            c.snapshot({"w": torch.full((1000,), float(r))}, d.root / "global_step2" / f"rank{r}.pt", tag="global_step2")
            c.wait()
        futures = [c0.commit("global_step2"), c1.commit("global_step2")]
        assert back.stdout is not None and back.stdout.readline().strip() == "COMMITTED"
        assert back.wait(60) == 0
        for fut in futures:
            assert len(fut.result(timeout=120).files) == 3
    assert datastates.latest(d.root) == "global_step2"
    for r in range(3):
        w = datastates.load(d.root / "global_step2" / f"rank{r}.pt")["w"]
        assert torch.equal(w, torch.full(w.shape, float(r))), f"rank {r}'s file holds other values"


def test_a_late_node_costs_node_0_a_listing_a_look_not_an_open_per_missing_node(
        start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Four nodes; node 0's rank commits and nodes 1-3 are 3 s late: meanwhile node 0 looks for their done markers
    by listing the tag's folder (each look one listing, the looks growing apart), and opens none of the three
    missing markers again and again, as a poll per missing node would (3 opens a look). Then the tag commits."""
    nodes = start_daemons(*[{"commit_timeout": 30}] * 4)  # a failure here ends the gathering soon, not in 600 s
    root: Path = nodes[0].root
    clients = [rank_client(d, i, 4, 1, 4, job="late") for i, d in enumerate(nodes)]
    try:
        for i, c in enumerate(clients):
            c.snapshot({"w": torch.full((64,), float(i))}, root / "global_step1" / f"rank{i}.pt", tag="global_step1")
            c.wait()
        first = clients[0].commit("global_step1")
        for _ in range(1200):  # a hang guard: node 0 has written its done marker and gathers
            if list((root / "global_step1").glob("datastates-done.*")):
                break
            time.sleep(0.05)
        before = daemon_status(nodes[0].endpoint)["daemon"]["metadata_ops"]
        time.sleep(3.0)  # nodes 1-3 late
        after = daemon_status(nodes[0].endpoint)["daemon"]["metadata_ops"]
        spent = {k: after[k] - before[k] for k in after}
        assert spent["list"] >= 2, spent  # it did look (and the daemon counts what it does)
        assert spent["list"] <= 30, spent  # looks growing apart: 3 s of them at 0.2 s would be 15, at 0.05 s 60
        assert spent["open"] <= 6, spent  # not 3 missing markers opened a look
        futures = [first] + [c.commit("global_step1") for c in clients[1:]]
        for fut in futures:
            assert len(fut.result(timeout=120).files) == 4
    finally:
        for c in clients:
            c.close()
    assert datastates.latest(root) == "global_step1"
    assert not list((root / "global_step1").glob("datastates-done.*"))


@pytest.mark.heavy
def test_a_node_that_gave_up_waiting_is_never_committed_by_node_0_afterwards(
        start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Three nodes: node 1 reports and waits 2 s (its commit_timeout); node 0 has read node 1's done marker but waits
    for node 2, which commits only after node 1 gave up and told its rank the tag failed. Node 0 must not commit
    the tag then (node 1's rank was told it failed): every rank's commit fails and no marker appears."""
    nodes = start_daemons({"commit_timeout": 60}, {"commit_timeout": 2}, {"commit_timeout": 4})
    root: Path = nodes[0].root
    clients = [rank_client(d, i, 3, 1, 3, job="gaveup") for i, d in enumerate(nodes)]
    try:
        for i, c in enumerate(clients):
            c.snapshot({"w": torch.full((64,), float(i))}, root / "global_step1" / f"rank{i}.pt", tag="global_step1")
            c.wait()
        second = clients[1].commit("global_step1")
        first = clients[0].commit("global_step1")
        with pytest.raises(CommitError, match="node 0 wrote no marker"):
            second.result(timeout=120)  # node 1 gave up: its rank is told the tag failed
        third = clients[2].commit("global_step1")  # node 2 reports only now: node 0 has every node's report read
        for fut in (first, third):
            with pytest.raises(CommitError, match="global_step1"):
                fut.result(timeout=120)
    finally:
        for c in clients:
            c.close()
    assert not (root / "global_step1" / marker_name("global_step1")).exists()
    assert datastates.latest(root) is None
