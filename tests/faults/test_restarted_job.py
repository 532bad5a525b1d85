"""A multi-node job that dies part-way through a tag's commit and restarts: the tag commits with this attempt's files
on every node, never with what a rank of the failed attempt left.

Two daemons on one shared root play two nodes (as in tests/test_multirank.py); each rank is
a process of its own, started anew for the restarted attempt, as torchrun or Slurm start them.
Attempt 1's rank on node 1 saves and commits ``global_step2`` (node 1's done marker is
written), then the job dies before node 0's rank saves. Attempt 2 reaches ``global_step2``
again: node 0's rank commits first, and the tag must wait for attempt 2's rank on node 1.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.client.ranks import ranks_from_env
from datastates.protocol.descriptors import Ranks
from datastates.protocol.format import done_name, marker_name

from conftest import DaemonProc
from test_tiers import tiers_cfg

SHORT_TRIALS, LONG_TRIALS = 8, 80
"""Randomized restarts: a few in CI (the test is heavy), LONG_TRIALS with ``--long`` or DATASTATES_RESTARTS=N."""

TAG = "global_step2"

RANK = (
    "import os, sys, time, torch\n"
    "from datastates.client import Client\n"
    "from datastates.protocol.descriptors import Ranks\n"
    "endpoint, root, tag, rank, value, job, name = sys.argv[1:]\n"
    "rank = int(rank)\n"
    "while not os.path.exists(os.environ.get('GATE', '/')):\n"
    "    time.sleep(0.05)\n"
    "c = Client(endpoint, timeout=60, ranks=Ranks(rank=rank, world_size=2, node_rank=rank, num_nodes=2, job=job))\n"
    "c.snapshot({'w': torch.full((256,), float(value))}, f'{root}/{tag}/{name}')\n"
    "c.wait()\n"
    "fut = c.commit(tag)\n"
    "print('ASKED', flush=True)\n"
    "try:\n"
    "    fut.result(timeout=120)\n"
    "    print('COMMITTED', flush=True)\n"
    "except Exception as exc:\n"
    "    print('FAILED', type(exc).__name__, exc, flush=True)\n"
    "c.close()\n"
)
"""Rank ``rank`` of ``job``, 2 ranks on 2 nodes: once the file ``$GATE`` exists (if set), saves ``tag/name`` as a
state of ``value``, commits, prints the outcome."""


def start(d: DaemonProc, r: int, value: float, tag: str = TAG, job: str = "j", name: str = "",
          gate: Path | None = None) -> subprocess.Popen:
    """The rank's process, started now; with ``gate``, it saves only once that file exists (a rank of the attempt
    that reaches the save later than the others: its process starts with theirs, as a launcher starts them)."""
    env = {**os.environ, "GATE": str(gate)} if gate else None
    return subprocess.Popen([sys.executable, "-c", RANK, d.endpoint, str(d.root), tag, str(r), str(value), job,
                             name or f"rank{r}.pt"], stdout=subprocess.PIPE, text=True, env=env)


def asked(proc: subprocess.Popen) -> subprocess.Popen:
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ASKED"
    return proc


def rank(d: DaemonProc, r: int, value: float, tag: str = TAG, job: str = "j", name: str = "") -> subprocess.Popen:
    """The rank's process, once it has asked to commit."""
    return asked(start(d, r, value, tag, job, name))


def outcome(proc: subprocess.Popen) -> str:
    """What the rank's commit was told: its last line."""
    out, _ = proc.communicate(timeout=180)
    return (out.strip().splitlines() or [""])[-1]


def eventually(what: str, cond: Callable[[], bool], within: float = 60) -> None:
    """A hang guard, not a timing check."""
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {within:.0f} s"
        time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


@pytest.mark.heavy
@pytest.mark.parametrize("death", ["its daemon lives on", "its daemon is killed and restarted",
                                   "its node is replaced"])
def test_a_restarted_job_never_commits_a_tag_with_a_failed_attempts_part(
        death: str, start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc]) -> None:
    """Whatever became of node 1 when attempt 1 died, attempt 2's node 0 does not commit ``TAG`` with attempt 1's
    part of node 1: it waits for attempt 2's rank 1, and the committed tag holds attempt 2's state on both nodes.

    - its daemon lives on: it sees attempt 1's rank die while waiting for node 0, and takes its done marker back;
    - its daemon is killed and restarted: the new daemon removes the dead one's done marker as it starts;
    - its node is replaced (a new host, the old one's done marker still on the shared root): node 0 takes no done
      marker written before its own ranks of this attempt started.
    """
    n0, n1 = start_daemons({}, {})
    done = n0.root / TAG / done_name(TAG, 1)
    old = rank(n1, 1, 1.0)  # attempt 1: node 1's rank commits, node 0's never gets there
    eventually("node 1's done marker", done.exists)
    left = done.read_bytes()
    kill(old)
    if death == "its daemon lives on":
        eventually("node 1 taking back its done marker once its rank is dead", lambda: not done.exists())
    else:
        kill(n1.proc)
        n1 = start_daemon(endpoint=n1.endpoint)
        eventually("the restarted daemon removing its dead predecessor's done marker", lambda: not done.exists())
        if death == "its node is replaced":
            done.write_bytes(left)  # a new host's daemon never touches the lost host's files
            time.sleep(1.5)  # the job restarts: its new processes start more than the nodes' clock skew later

    gate = n0.root.parent / "rank1-saves"  # attempt 2: node 0's rank commits before node 1's has saved anything
    second = start(n1, 1, 21.0, gate=gate)
    first = rank(n0, 0, 20.0)
    eventually("node 0 gathering the tag", lambda: bool(daemon_status(n0.endpoint)["tags_gathering"]))
    time.sleep(1.0)  # node 0 looks many times a second: a commit with the leftover would be in place by now
    assert not (n0.root / TAG / marker_name(TAG)).exists(), f"{TAG} committed before attempt 2's rank 1 saved it"
    gate.touch()
    asked(second)
    assert outcome(first) == "COMMITTED" and outcome(second) == "COMMITTED"
    assert datastates.latest(n0.root) == TAG
    for r, value in ((0, 20.0), (1, 21.0)):
        got = datastates.load(n0.root / TAG / f"rank{r}.pt")["w"]
        assert torch.equal(got, torch.full((256,), value)), f"rank{r}.pt holds {got[0].item()}, not attempt 2's {value}"
    assert not done.exists()


@pytest.mark.heavy
def test_a_dead_attempts_rank_is_never_told_committed_by_a_live_daemon(
        start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Attempt 1's rank on node 1 still waits (hung, not dead) when attempt 2's rank 0 commits the tag: node 0 does
    not take its part (written before node 0's new rank started), so the hung rank is not told COMMITTED; its
    commit fails at commit_timeout, and no marker of the tag appears."""
    n0, n1 = start_daemons({"commit_timeout": 4}, {"commit_timeout": 4})
    hung = rank(n1, 1, 1.0)
    eventually("node 1's done marker", (n0.root / TAG / done_name(TAG, 1)).exists)
    time.sleep(1.5)  # the job restarts: its new processes start more than the nodes' clock skew later
    first = rank(n0, 0, 20.0)
    assert outcome(hung).startswith("FAILED CommitError")
    assert outcome(first).startswith("FAILED CommitError")
    assert not (n0.root / TAG / marker_name(TAG)).exists()
    assert datastates.latest(n0.root) is None


@pytest.mark.heavy
def test_a_round_of_a_dead_attempt_still_waiting_never_commits_with_a_later_attempts_part(
        start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Attempt 1's rank on node 0 asked to commit and waits, hung (or killed where its daemon cannot see it die);
    attempt 2, under the same job name, starts on node 1 and commits the tag: node 0's waiting round does not take
    that part (its ranks started after node 0's round was asked for), so neither rank is told COMMITTED and no
    marker holds a mix of the two attempts."""
    n0, n1 = start_daemons({"commit_timeout": 6}, {"commit_timeout": 6})
    hung = rank(n0, 0, 1.0)
    eventually("node 0 gathering the tag", lambda: bool(daemon_status(n0.endpoint)["tags_gathering"]))
    time.sleep(1.5)  # the job restarts: its new processes start more than the nodes' clock skew later
    later = rank(n1, 1, 21.0)
    assert outcome(hung).startswith("FAILED CommitError") and outcome(later).startswith("FAILED CommitError")
    assert not (n0.root / TAG / marker_name(TAG)).exists(), f"{TAG} committed with two attempts' files"


@pytest.mark.heavy
@pytest.mark.parametrize("when", ["before the dead attempt's round gives up", "after it gave up"])
def test_a_waiting_round_of_a_dead_attempt_neither_confirms_nor_withdraws_a_later_attempts_commit(
        when: str, start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Attempt 1's rank on node 1 asked to commit and waits, hung; attempt 2 (a new Slurm step: another job name,
    its own file names) commits the tag on both nodes, before or after attempt 1's round on node 1 gave up at
    commit_timeout. The hung rank is not told COMMITTED (the marker lists attempt 2's files, not its own), and its
    round, giving up, leaves attempt 2's done marker of node 1 in place, so attempt 2 commits."""
    n0, n1 = start_daemons({"commit_timeout": 5}, {"commit_timeout": 5})
    hung = rank(n1, 1, 1.0)
    eventually("node 1's done marker", (n0.root / TAG / done_name(TAG, 1)).exists)
    time.sleep(1.5)
    gate = n0.root.parent / "rank0-saves"
    first = start(n0, 0, 20.0, job="j.2", gate=gate)
    second = rank(n1, 1, 21.0, job="j.2", name="rank1-new.pt")
    if when == "after it gave up":
        assert outcome(hung).startswith("FAILED CommitError")
    gate.touch()
    assert outcome(first) == "COMMITTED" and outcome(second) == "COMMITTED"
    assert outcome(hung).startswith("FAILED CommitError")
    assert datastates.latest(n0.root) == TAG
    got = datastates.load(n0.root / TAG / "rank1-new.pt")["w"]
    assert torch.equal(got, torch.full((256,), 21.0)), f"rank1-new.pt holds {got[0].item()}, not attempt 2's 21.0"


@pytest.mark.heavy
def test_a_transfer_resumed_by_a_restarted_daemon_commits_the_tag_on_the_shared_tier(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """Node-local fast tiers and a shared one below. Node 1's daemon is killed while its transfer of the tag waits
    for node 0 on the shared tier; its restart resumes the transfer as the same job, so node 0's transfer takes its
    done marker and the shared tier commits the tag with both nodes' files."""
    cfgs = [dict(tiers_cfg(tmp_path, node=f"node{n}-"), commit_timeout=30) for n in range(2)]
    n0, n1 = start_daemons(*cfgs)
    tag, pfs = "global_step3", tmp_path / "pfs" / "run"
    clients = [Client(d.endpoint, timeout=60, ranks=Ranks(rank=r, world_size=2, node_rank=r, num_nodes=2, job="j"))
               for r, d in enumerate((n0, n1))]
    try:
        clients[1].snapshot({"w": torch.full((256,), 1.0)}, tmp_path / "node1-fast" / "run" / tag / "rank1.pt")
        clients[1].wait()
        clients[1].commit(tag).result(timeout=60)  # on node 1's own fast tier
        done = pfs / tag / done_name(tag, 1)
        eventually("node 1's done marker on the shared tier", done.exists)
        kill(n1.proc)
        start_daemon(**cfgs[1])
        eventually("the resumed transfer's done marker", done.exists)
        clients[0].snapshot({"w": torch.full((256,), 0.0)}, tmp_path / "node0-fast" / "run" / tag / "rank0.pt")
        clients[0].wait()
        clients[0].commit(tag).result(timeout=60)
        eventually("the shared tier committing the tag", lambda: datastates.latest(pfs) == tag, within=120)
    finally:
        clients[0].close(timeout=5)
        clients[1].timeout = 1  # its daemon was killed: no BYE reply will come
        clients[1].close(timeout=1)
    for r in range(2):
        assert torch.equal(datastates.load(pfs / tag / f"rank{r}.pt")["w"], torch.full((256,), float(r)))


@pytest.mark.parametrize("step, restarts, job", [("", "", "77"), ("2", "0", "77.2"), ("2", "3", "77.2#3")])
def test_each_attempt_of_a_slurm_job_is_a_job_of_its_own(step: str, restarts: str, job: str) -> None:
    """An srun run again (a new step) and a requeued job (its restart count) are attempts of their own, the same on
    every node, whose tags commit only with their own attempt's done markers. torchrun's restart count is left out:
    it differs between nodes (an agent whose workers did not fail restarts them without counting it)."""
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": step,
             "SLURM_RESTART_COUNT": restarts}
    assert ranks_from_env(slurm).job == job
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "77",
                "TORCHELASTIC_RESTART_COUNT": "1"}
    assert ranks_from_env(torchrun).job == "77"


DEATHS = ("ranks only", "node 0's daemon killed", "node 1's daemon killed", "the node replaced")
CASES = [(lone, death) for death in DEATHS for lone in (0, 1)]
"""Which node's rank of attempt 1 commits, and what dies with the job: trial n takes case n, in turn."""


@pytest.mark.heavy
@pytest.mark.timeout(600 + 60 * LONG_TRIALS)
def test_random_restarts_commit_each_tag_whole_from_one_attempt(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc], long_runs: bool) -> None:
    """Seeded trials (``DATASTATES_SEED`` the first), through every case in turn: attempt 1's rank on one node
    commits a tag and the job dies at a random moment, with a daemon or the whole node, or only its ranks;
    attempt 2's ranks start together and save the tag again, one of them (either) up to 1.5 s later. Each time the tag commits, with attempt 2's state in every file, and both
    of attempt 2's ranks are told COMMITTED."""
    trials = int(os.environ.get("DATASTATES_RESTARTS", "") or (LONG_TRIALS if long_runs else SHORT_TRIALS))
    first_seed = int(os.environ.get("DATASTATES_SEED", "1"))
    nodes = start_daemons({"client_timeout": 2}, {"client_timeout": 2})
    root = nodes[0].root
    for seed in range(first_seed, first_seed + trials):
        rng = random.Random(seed)
        tag, (lone, death) = f"step{seed}", CASES[seed % len(CASES)]
        trial = f"seed {seed}: attempt 1's rank {lone}, then {death}"
        done = root / tag / done_name(tag, lone)
        old = rank(nodes[lone], lone, -1.0, tag)
        eventually(f"{trial}: its done marker", done.exists)
        left = done.read_bytes()
        time.sleep(rng.uniform(0, 0.5))
        kill(old)
        if death != "ranks only":
            hit = 0 if death == "node 0's daemon killed" else 1 if death == "node 1's daemon killed" else lone
            kill(nodes[hit].proc)
            nodes[hit] = start_daemon(endpoint=nodes[hit].endpoint, client_timeout=2)
            if death == "the node replaced":
                eventually(f"{trial}: the dead daemon's done marker removed", lambda: not done.exists())
                done.write_bytes(left)
        time.sleep(1.5)  # the launcher restarts the job: its new processes start after the nodes' clock skew
        values = {r: seed * 10.0 + r for r in (0, 1)}
        early, late = rng.sample((0, 1), 2)
        gate = root.parent / f"gate{seed}"
        ranks = {late: start(nodes[late], late, values[late], tag, gate=gate),
                 early: start(nodes[early], early, values[early], tag)}
        asked(ranks[early])
        time.sleep(rng.uniform(0, 1.5))
        gate.touch()
        told = {r: outcome(p) for r, p in ranks.items()}
        assert told == {0: "COMMITTED", 1: "COMMITTED"}, f"{trial}: attempt 2's ranks were told {told}"
        for r, value in values.items():
            got = datastates.load(root / tag / f"rank{r}.pt")["w"]
            assert torch.equal(got, torch.full((256,), value)), \
                f"{trial}: committed rank{r}.pt holds {got[0].item()}, not attempt 2's {value}"
    assert datastates.latest(root) == f"step{first_seed + trials - 1}"
