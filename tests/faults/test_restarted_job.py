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
from datastates.client import daemon_status
from datastates.client.ranks import ranks_from_env
from datastates.protocol.format import done_name, marker_name

from conftest import DaemonProc

SHORT_TRIALS, LONG_TRIALS = 8, 80
"""Randomized restarts: a few in CI (the test is heavy), LONG_TRIALS with ``--long`` or DATASTATES_RESTARTS=N."""

TAG = "global_step2"

RANK = (
    "import sys, torch\n"
    "from datastates.client import Client\n"
    "from datastates.protocol.descriptors import Ranks\n"
    "endpoint, root, tag, rank, value = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])\n"
    "c = Client(endpoint, timeout=60, ranks=Ranks(rank=rank, world_size=2, node_rank=rank, num_nodes=2, job='j'))\n"
    "c.snapshot({'w': torch.full((256,), value)}, f'{root}/{tag}/rank{rank}.pt')\n"
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
"""Rank ``rank`` of a job of 2 ranks on 2 nodes: saves ``tag`` as a state of ``value``, commits, prints the outcome."""


def rank(d: DaemonProc, r: int, value: float, tag: str = TAG) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RANK, d.endpoint, str(d.root), tag, str(r), str(value)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ASKED"
    return proc


def outcome(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=180)
    return out.strip()


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

    first = rank(n0, 0, 20.0)  # attempt 2: node 0's rank commits before node 1's has saved anything
    eventually("node 0 gathering the tag", lambda: bool(daemon_status(n0.endpoint)["tags_gathering"]))
    time.sleep(1.0)  # node 0 looks many times a second: a commit with the leftover would be in place by now
    assert not (n0.root / TAG / marker_name(TAG)).exists(), f"{TAG} committed before attempt 2's rank 1 saved it"
    second = rank(n1, 1, 21.0)
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


@pytest.mark.parametrize("restarts, job", [("", "run7"), ("0", "run7"), ("3", "run7#3")])
def test_each_attempt_of_a_restarted_launch_is_a_job_of_its_own(restarts: str, job: str) -> None:
    """torchrun and Slurm count restarts of one run id: each attempt's ranks are a job of their own, whose tags
    commit only with their own attempt's done markers."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "run7"}
    if restarts:
        env["TORCHELASTIC_RESTART_COUNT"] = restarts
    assert ranks_from_env(env).job == job
    slurm = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_ID": "run7"}
    if restarts:
        slurm["SLURM_RESTART_COUNT"] = restarts
    assert ranks_from_env(slurm).job == job


DEATHS = ("ranks only", "node 0's daemon killed", "node 1's daemon killed", "the node replaced")
CASES = [(lone, death) for death in DEATHS for lone in (0, 1)]
"""Which node's rank of attempt 1 commits, and what dies with the job: trial n takes case n, in turn."""


@pytest.mark.heavy
@pytest.mark.timeout(600 + 60 * LONG_TRIALS)
def test_random_restarts_commit_each_tag_whole_from_one_attempt(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc], long_runs: bool) -> None:
    """Seeded trials (``DATASTATES_SEED`` the first), through every case in turn: attempt 1's rank on one node
    commits a tag and the job dies at a random moment, with a daemon or the whole node, or only its ranks;
    attempt 2's ranks start in a random order and save the tag again. Each time the tag commits, with attempt 2's state in every file, and both
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
        ranks = {}
        for r in rng.sample((0, 1), 2):
            ranks[r] = rank(nodes[r], r, values[r], tag)
            time.sleep(rng.uniform(0, 0.3))
        told = {r: outcome(p) for r, p in ranks.items()}
        assert told == {0: "COMMITTED", 1: "COMMITTED"}, f"{trial}: attempt 2's ranks were told {told}"
        for r, value in values.items():
            got = datastates.load(root / tag / f"rank{r}.pt")["w"]
            assert torch.equal(got, torch.full((256,), value)), \
                f"{trial}: committed rank{r}.pt holds {got[0].item()}, not attempt 2's {value}"
    assert datastates.latest(root) == f"step{first_seed + trials - 1}"
