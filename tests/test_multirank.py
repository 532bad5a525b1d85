"""Many ranks on one daemon, and many daemons on one shared root: a tag commits once every rank has.

Each "node" here is its own datastatesd with its own endpoint; the daemons never talk,
they meet on the shared root through done markers, as on a real cluster's parallel file
system. The torchrun case launches 2 nodes x 2 ranks for real, with gloo on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.errors import CommitError, PathNotAllowedError
from datastates.protocol.format import TRACKER, done_name, marker_name

from conftest import BIN, DaemonProc, assert_state_equal, rank_client, save

HERE = Path(__file__).parent


def gathering_tags(d: DaemonProc) -> list[dict]:
    """The daemon's multi-rank tags once the COMMIT sent just now has reached it (a hang guard, not a timing check)."""
    for _ in range(1200):
        gathering = daemon_status(d.endpoint)["tags_gathering"]
        if gathering:
            return gathering
        time.sleep(0.05)
    raise AssertionError("the daemon never listed the tag as gathering")


def marker_files(root: Path, tag: str) -> list[str]:
    return sorted(f["path"] for f in json.loads((root / tag / marker_name(tag)).read_text())["files"])


def test_a_tag_commits_once_every_local_rank_has(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    states = [{"w": torch.randn(1000), "rank": r} for r in range(2)]
    with rank_client(d, 0, 2, 2, 1) as c0, rank_client(d, 1, 2, 2, 1) as c1:
        st = daemon_status(d.endpoint)
        assert sorted((c["rank"], c["world_size"]) for c in st["clients"]) == [(0, 2), (1, 2)]
        c0.snapshot(states[0], d.root / "global_step1" / "rank0.pt")
        c0.wait()
        first = c0.commit("global_step1")
        gathering = gathering_tags(d)
        assert gathering == [{"tag": "global_step1", "job": "j1", "committed_ranks": [0], "local_ranks": 2, "nodes": 1}]
        assert not first.done() and datastates.latest(d.root) is None  # rank 1 has not committed
        c1.snapshot(states[1], d.root / "global_step1" / "rank1.pt")
        c1.wait()
        second = c1.commit("global_step1")
        for fut in (first, second):
            assert sorted(fut.result(timeout=120).files) == [str(d.root / "global_step1" / f"rank{r}.pt") for r in range(2)]
    assert datastates.latest(d.root) == "global_step1"
    assert marker_files(d.root, "global_step1") == ["rank0.pt", "rank1.pt"]
    assert (d.root / TRACKER).read_text() == "global_step1"
    for r in range(2):
        assert_state_equal(states[r], datastates.load(d.root / "global_step1" / f"rank{r}.pt"))


def test_a_rank_that_saved_nothing_still_counts(start_daemon: Callable[..., DaemonProc]) -> None:
    """DeepSpeed has ranks that write no file for a tag; they commit all the same."""
    d = start_daemon()
    with rank_client(d, 0, 2, 2, 1) as c0, rank_client(d, 1, 2, 2, 1) as c1:
        c0.snapshot({"w": torch.ones(4)}, d.root / "iter_0000010" / "model.pt")  # rank 1 writes nothing
        c0.wait()
        futs = [c0.commit("iter_0000010"), c1.commit("iter_0000010")]
        for fut in futs:
            fut.result(timeout=120)
    assert datastates.latest(d.root) == "iter_0000010"
    assert (d.root / "latest_checkpointed_iteration.txt").read_text() == "10"


def test_latest_is_the_tag_asked_for_last_even_when_an_older_one_commits_after_it(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Concurrent tags finish in any order (here rank 1 commits them backwards); resume must not go back a step."""
    d = start_daemon()
    with rank_client(d, 0, 2, 2, 1) as c0, rank_client(d, 1, 2, 2, 1) as c1:
        for step in (1, 2):
            for r, c in enumerate((c0, c1)):
                c.snapshot({"step": step, "rank": r}, d.root / f"global_step{step}" / f"rank{r}.pt")
        c0.wait()
        c1.wait()
        futs = [c0.commit("global_step1"), c0.commit("global_step2")]
        while len(gathering_tags(d)) < 2:
            time.sleep(0.05)
        futs.append(c1.commit("global_step2"))
        futs[-1].result(timeout=120)
        futs.append(c1.commit("global_step1"))  # committed, and so published, after global_step2
        for fut in futs:
            fut.result(timeout=120)
    markers = {t: json.loads((d.root / t / marker_name(t)).read_text()) for t in ("global_step1", "global_step2")}
    assert markers["global_step1"]["committed_ns"] > markers["global_step2"]["committed_ns"]
    assert datastates.latest(d.root) == "global_step2"
    assert (d.root / TRACKER).read_text() == "global_step2"
    assert datastates.load(d.root / "global_step2" / "rank1.pt") == {"step": 2, "rank": 1}


def test_no_rank_starves_another(start_daemon: Callable[..., DaemonProc]) -> None:
    """Pool chunks go round-robin between ranks: a small snapshot is copied long before a huge one sent first."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1)
    with rank_client(d, 0, 2, 2, 1) as big, rank_client(d, 1, 2, 2, 1) as small:
        big.snapshot({"w": torch.randn(64 << 20)}, d.root / "global_step1" / "rank0.pt")  # 256 MiB
        small.snapshot({"w": torch.randn(1 << 20)}, d.root / "global_step1" / "rank1.pt")  # 4 MiB, sent second
        small.wait()
        big_job = next(j for j in daemon_status(d.endpoint)["snapshots"] if j["client"] == big.client_id)
        assert big_job["state"] == "copying", big_job  # first come, first served would have copied all of it first
        futs = [big.commit("global_step1"), small.commit("global_step1")]
        for fut in futs:
            fut.result(timeout=300)


def two_nodes(start_daemons: Callable[..., list[DaemonProc]], **cfg: object) -> tuple[DaemonProc, DaemonProc]:
    """Two daemons, as on two nodes: own endpoints, one shared root (started side by side)."""
    n0, n1 = start_daemons(cfg, cfg)
    return n0, n1


def test_two_nodes_commit_through_the_shared_root(start_daemons: Callable[..., list[DaemonProc]]) -> None:
    n0, n1 = two_nodes(start_daemons)
    states = [{"w": torch.randn(100), "rank": r} for r in range(4)]
    clients = [rank_client(n0 if r < 2 else n1, r, 4, 2, 2) for r in range(4)]
    try:
        for r, c in enumerate(clients):
            c.snapshot(states[r], n0.root / "global_step3" / f"rank{r}.pt")
            c.wait()
        futs = [c.commit("global_step3") for c in clients]
        for fut in futs:
            assert len(fut.result(timeout=120).files) == 4
    finally:
        for c in clients:
            c.close()
    assert datastates.latest(n0.root) == "global_step3"
    assert marker_files(n0.root, "global_step3") == [f"rank{r}.pt" for r in range(4)]
    assert not list((n0.root / "global_step3").glob("datastates-done.*"))  # node 0 tidied the done markers
    for r in range(4):
        assert_state_equal(states[r], datastates.load(n0.root / "global_step3" / f"rank{r}.pt"))


def test_a_node_that_dies_leaves_the_tag_uncommitted(start_daemons: Callable[..., list[DaemonProc]]) -> None:
    n0, n1 = two_nodes(start_daemons, commit_timeout=3)
    with Client(n0.endpoint, timeout=60) as solo:
        save(solo, {"w": torch.zeros(3)}, n0.root / "global_step1" / "model.pt")
    c0, c1 = rank_client(n0, 0, 2, 1, 2), rank_client(n1, 1, 2, 1, 2)
    try:
        c0.snapshot({"w": torch.ones(3)}, n0.root / "global_step2" / "rank0.pt")
        c1.snapshot({"w": torch.ones(3)}, n0.root / "global_step2" / "rank1.pt")
        c0.wait()
        c1.wait()
        n1.proc.send_signal(signal.SIGKILL)  # node 1's daemon dies before its rank commits
        n1.proc.wait(30)
        with pytest.raises(CommitError, match=r"node\(s\) \[1\] wrote no done marker"):
            c0.commit("global_step2").result(timeout=120)
    finally:
        c0.close()
        c1.timeout = 1  # its daemon is dead: no BYE reply will come, so do not wait the default 5 s for one
        c1.close(timeout=1)
    assert datastates.latest(n0.root) == "global_step1"
    assert not (n0.root / "global_step2" / marker_name("global_step2")).exists()


def test_a_node_other_than_0_confirms_a_commit_only_once_node_0s_marker_exists(
        start_daemons: Callable[..., list[DaemonProc]]) -> None:
    """Node 1 has all its files durable and its done marker written, but node 0's rank never commits: node 1 must
    not confirm the tag (no marker exists); it fails the commit at commit_timeout, withdraws its done marker, and
    the tag stays uncommitted."""
    n0, n1 = two_nodes(start_daemons, commit_timeout=1)
    c0, c1 = rank_client(n0, 0, 2, 1, 2), rank_client(n1, 1, 2, 1, 2)
    try:
        for r, c in enumerate((c0, c1)):
            c.snapshot({"w": torch.full((3,), float(r))}, n0.root / "global_step1" / f"rank{r}.pt")
            c.wait()
        with pytest.raises(CommitError, match="node 0 wrote no marker"):
            c1.commit("global_step1").result(timeout=120)
        # Told the tag failed, node 1 takes back its part, so node 0's rank committing late cannot commit it.
        assert not (n0.root / "global_step1" / done_name("global_step1", 1)).exists()
    finally:
        c0.close()
        c1.close()
    assert not (n0.root / "global_step1" / marker_name("global_step1")).exists()
    assert datastates.latest(n0.root) is None


@pytest.mark.heavy
def test_a_node_killed_mid_commit_fails_the_tag_on_every_node_and_the_next_commits_once_it_is_back(
        start_daemons: Callable[..., list[DaemonProc]], start_daemon: Callable[..., DaemonProc]) -> None:
    """Three nodes of one job; node 1's daemon is killed right after its rank asked to commit: every node's commit of
    the tag fails within commit_timeout, no marker of it appears and the last tag stays the latest; once a new
    daemon serves node 1, the job's next tag commits on all three."""
    nodes = start_daemons(*[{"commit_timeout": 3}] * 3)
    root = nodes[0].root
    clients = [rank_client(d, i, 3, 1, 3) for i, d in enumerate(nodes)]

    def save_all(tag: str, before_commit: Callable[[], None] = lambda: None) -> list:
        for i, c in enumerate(clients):
            c.snapshot({"w": torch.full((64,), float(i)), "tag": tag}, root / tag / f"rank{i}.pt")
        for c in clients:
            c.wait()
        before_commit()
        return [c.commit(tag) for c in clients]

    try:
        for fut in save_all("global_step1"):
            fut.result(timeout=120)
        # stopped before its rank's COMMIT reaches it, so it can never have written its done marker: then killed
        futures = save_all("global_step2", lambda: nodes[1].proc.send_signal(signal.SIGSTOP))
        nodes[1].proc.send_signal(signal.SIGKILL)
        nodes[1].proc.wait(30)
        started = time.monotonic()
        for i in (0, 2):
            with pytest.raises(CommitError, match="global_step2"):
                futures[i].result(timeout=120)
        assert time.monotonic() - started < 60, "the survivors' commits waited far past commit_timeout (3 s)"
        assert not (root / "global_step2" / marker_name("global_step2")).exists()
        assert datastates.latest(root) == "global_step1"

        clients[1].timeout = 1  # its daemon is dead: no BYE reply will come
        clients[1].close(timeout=1)
        back = start_daemon(endpoint=nodes[1].endpoint, commit_timeout=3)
        clients[1] = rank_client(back, 1, 3, 1, 3)
        for fut in save_all("global_step3"):
            fut.result(timeout=120)
    finally:
        for c in clients:
            c.timeout = 5
            c.close(timeout=5)
    assert datastates.latest(root) == "global_step3"
    assert marker_files(root, "global_step3") == [f"rank{r}.pt" for r in range(3)]
    for r in range(3):
        assert torch.equal(datastates.load(root / "global_step3" / f"rank{r}.pt")["w"], torch.full((64,), float(r)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.heavy
def test_torchrun_two_nodes_two_ranks_each(start_daemons: Callable[..., list[DaemonProc]]) -> None:
    n0, n1 = two_nodes(start_daemons)
    port = free_port()
    procs = []
    for node, d in enumerate((n0, n1)):
        env = {**os.environ, "DATASTATES_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(HERE / "multinode_train.py"), str(n0.root), "3"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0, out
    assert datastates.latest(n0.root) == "global_step3"
    assert marker_files(n0.root, "global_step3") == [f"rank{r}.pt" for r in range(4)]
    assert (n0.root / TRACKER).read_text() == "global_step3"
    loaded = [datastates.load(n0.root / "global_step3" / f"rank{r}.pt") for r in range(4)]
    for r, state in enumerate(loaded):
        assert state["rank"] == r and state["step"] == 3
        assert_state_equal(loaded[0]["model"], state["model"])  # data-parallel replicas agree bitwise


@pytest.mark.parametrize("when", ["while the others wait in the round", "after its snapshot, before any commit",
                                  "before its snapshot, after the others' snapshots"])
def test_a_rank_killed_before_committing_fails_the_tag_at_once(when: str,
                                                              start_daemon: Callable[..., DaemonProc]) -> None:
    """The other ranks' commits fail when the daemon sees the rank gone, not after commit_timeout: those waiting in
    the round, and those that ask to commit only afterwards a tag the killed rank had snapshotted, or they had
    (a COMMIT read after the daemon saw the rank go: on a busy machine it can wait that long for its sequence)."""
    d = start_daemon(client_timeout=1.5)  # commit_timeout stays 600 s: a pass shows it was not waited for
    rank1 = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch\n"
        "from datastates.client import Client\n"
        "from datastates.protocol.descriptors import Ranks\n"
        "c = Client(sys.argv[1], ranks=Ranks(rank=1, local_rank=1, world_size=2, local_world_size=2, job='j1'))\n"
        "if sys.argv[2]:\n"
        "    c.snapshot({'w': torch.ones(3)}, sys.argv[2])\n"
        "    c.wait()\n"
        "print('READY', flush=True)\n"
        "time.sleep(600)\n"), d.endpoint,
        str(d.root / "global_step1" / "rank1.pt") if when == "after its snapshot, before any commit" else ""],
        stdout=subprocess.PIPE, text=True)
    assert rank1.stdout is not None and rank1.stdout.readline().strip() == "READY"
    with rank_client(d, 0, 2, 2, 1) as c0:
        c0.snapshot({"w": torch.ones(3)}, d.root / "global_step1" / "rank0.pt")
        c0.wait()
        if when == "while the others wait in the round":
            fut = c0.commit("global_step1")
        rank1.send_signal(signal.SIGKILL)
        rank1.wait(30)
        if when != "while the others wait in the round":
            for _ in range(600):  # a hang guard: the daemon has seen rank 1 go (its liveness, 1.5 s)
                if not any(c["rank"] == 1 for c in daemon_status(d.endpoint)["clients"]):
                    break
                time.sleep(0.05)
            fut = c0.commit("global_step1")
        with pytest.raises(CommitError, match="rank 1 is gone"):
            fut.result(timeout=120)
    assert datastates.latest(d.root) is None


@pytest.mark.parametrize("when", ["while the others wait in the round", "before any rank asked to commit"])
def test_a_rank_that_says_bye_without_committing_fails_the_tag_at_once(when: str,
                                                                      start_daemon: Callable[..., DaemonProc]) -> None:
    """A rank that closes its client without committing a tag it snapshotted (its save raised, as DCP's coordinator
    does when another rank died) never will: the other ranks' commits of it fail at once, not after commit_timeout
    (600 s), whether they were waiting in the round already or ask to commit it only afterwards."""
    d = start_daemon()
    with rank_client(d, 0, 2, 2, 1) as c0:
        with rank_client(d, 1, 2, 2, 1) as c1:
            c1.snapshot({"w": torch.ones(3)}, d.root / "global_step1" / "rank1.pt")
            c1.wait()
            c0.snapshot({"w": torch.ones(3)}, d.root / "global_step1" / "rank0.pt")
            c0.wait()
            if when == "while the others wait in the round":
                fut = c0.commit("global_step1")
                for _ in range(1200):  # a hang guard: rank 0's round has begun
                    if gathering_tags(d):
                        break
                    time.sleep(0.05)
        if when == "before any rank asked to commit":
            fut = c0.commit("global_step1")
        with pytest.raises(CommitError, match="rank 1 is gone"):
            fut.result(timeout=120)
    assert datastates.latest(d.root) is None


RANK = """
import sys, torch
from datastates.client import Client
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import DatastatesError
endpoint, rank, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ranks = Ranks(rank=rank, local_rank=rank, world_size=2, local_world_size=2, job="j1")
with Client(endpoint, timeout=60, ranks=ranks) as c:
    for line in iter(sys.stdin.readline, ""):  # the test says what and when: "save PATH STEP" or "commit"
        try:
            if line.startswith("save "):
                path, _, step = line[len("save "):].rstrip("\\n").rpartition(" ")
                c.snapshot({"w": torch.full((1000,), float(step)), "step": int(step)}, path, tag=tag)
                c.wait()
            else:
                c.commit(tag).result(timeout=3600)
            print("OK", flush=True)
        except DatastatesError as exc:
            print(type(exc).__name__, exc.message.replace("\\n", " "), flush=True)
"""


class RankProc:
    """One rank of job j1 (2 ranks, both on this node) in a process of its own, saving and committing ``tag`` as the
    test tells it; each answer is a line: OK, or the error's class and message."""

    def __init__(self, d: DaemonProc, rank: int, tag: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", RANK, d.endpoint, str(rank), tag], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def told(self) -> str:
        """The answer to the oldest command not yet read."""
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def ask(self, line: str) -> str:
        self.send(line)
        return self.told()


@contextlib.contextmanager
def rank_procs(d: DaemonProc, tag: str) -> Iterator[tuple[RankProc, RankProc]]:
    """Ranks 0 and 1 of job j1, each a process of its own; they must exit cleanly once told nothing more."""
    ranks = (RankProc(d, 0, tag), RankProc(d, 1, tag))
    try:
        yield ranks
        for r in ranks:
            assert r.proc.stdin is not None
            r.proc.stdin.close()
        for r in ranks:
            assert r.proc.wait(60) == 0
    finally:
        for r in ranks:
            r.proc.kill()


@pytest.mark.parametrize("refused_first", [True, False])
def test_a_refused_rank_fails_every_ranks_commit_at_once(start_daemon: Callable[..., DaemonProc],
                                                         refused_first: bool) -> None:
    """Rank 0's snapshot is refused by the daemon (its path is a file of another committed tag): rank 1's commit
    fails at once with that reason, whether it was already waiting or comes later, and rank 0's too.
    commit_timeout is 600 s: a pass within pytest's own timeout shows it was not waited for."""
    d = start_daemon(commit_timeout=600)
    with Client(d.endpoint, timeout=60) as solo:
        save(solo, {"w": torch.zeros(3)}, d.root / "other" / "rank0.pt", tag="other")
    paths = [d.root / "other" / "rank0.pt", d.root / "global_step1" / "rank1.pt"]
    with rank_procs(d, "global_step1") as (r0, r1):
        assert r1.ask(f"save {paths[1]} 1") == "OK"
        if refused_first:
            assert r0.ask(f"save {paths[0]} 1").startswith("PathNotAllowedError")
            told = [r1.ask("commit"), r0.ask("commit")]
        else:
            r1.send("commit")  # rank 1 commits and waits for rank 0
            gathering_tags(d)
            assert r0.ask(f"save {paths[0]} 1").startswith("PathNotAllowedError")
            told = [r1.told(), r0.ask("commit")]
        for r, line in enumerate(told):
            assert line.startswith("CommitError") and "rank0.pt" in line and "refused" in line, (r, line)
    assert not (d.root / "global_step1" / marker_name("global_step1")).exists()
    assert daemon_status(d.endpoint)["tags_gathering"] == []


def step_state(step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "step": step}


def save_rank(c: Client, path: Path, step: int) -> None:
    """One rank's snapshot of rolling tag ``last``, durable."""
    c.snapshot(step_state(step), path, tag="last")
    c.wait()


def refused_round(d: DaemonProc, r0: Client, r1: Client) -> None:
    """The first round of ``last``: rank 0's snapshot is refused (it names rank 1's uncommitted file), so rank 1's
    commit fails at once; rank 0's trainer carries on without committing the round."""
    save_rank(r1, d.root / "last" / "r1.pt", 1)
    told = r1.commit("last")
    r0.snapshot(step_state(1), d.root / "last" / "r1.pt", tag="last")
    with pytest.raises(PathNotAllowedError):
        r0.wait()
    with pytest.raises(CommitError, match="rank 0"):
        told.result(timeout=120)


def commit_both(d: DaemonProc, r0: Client, r1: Client, step: int) -> None:
    """Both ranks save ``step`` and commit it, rank 0 first (it waits in the round for rank 1): the marker lists
    both files, which hold that step."""
    for c, name in ((r0, "r0.pt"), (r1, "r1.pt")):
        save_rank(c, d.root / "last" / name, step)
    first = r0.commit("last")
    gathering_tags(d)
    for future in (first, r1.commit("last")):
        future.result(timeout=120)
    assert marker_files(d.root, "last") == ["r0.pt", "r1.pt"]
    for name in ("r0.pt", "r1.pt"):
        assert datastates.load(d.root / "last" / name)["step"] == step, name


def test_a_round_that_timed_out_is_never_joined_by_a_later_commit(start_daemon: Callable[..., DaemonProc]) -> None:
    """Rank 1's commit of step 1 waits for rank 0 until commit_timeout and is told so. Rank 0's step-1 commit, come
    late, is told the same failure: it does not join the timed-out round and commit the tag rank 1 was told had
    failed. Step 2 then commits both ranks' step-2 files."""
    d = start_daemon(commit_timeout=5)
    with rank_client(d, 0, 2, 2, 1) as r0, rank_client(d, 1, 2, 2, 1) as r1:
        save_rank(r1, d.root / "last" / "r1.pt", 1)
        with pytest.raises(CommitError, match="did not commit within"):
            r1.commit("last").result(timeout=120)
        save_rank(r0, d.root / "last" / "r0.pt", 1)
        with pytest.raises(CommitError, match="did not commit within"):
            r0.commit("last").result(timeout=120)
        assert not (d.root / "last" / marker_name("last")).exists()
        commit_both(d, r0, r1, 2)


def test_a_refused_ranks_later_commit_fails_the_round_another_rank_waits_in(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Rank 1 waits in the second round when rank 0, refused in the first, commits: rank 1 is told at once, not at
    commit_timeout (600 s: a pass within the 120 s the test waits shows it was not waited for); the third round
    commits."""
    d = start_daemon(commit_timeout=600)
    with rank_client(d, 0, 2, 2, 1) as r0, rank_client(d, 1, 2, 2, 1) as r1:
        refused_round(d, r0, r1)
        save_rank(r1, d.root / "last" / "r1.pt", 2)
        waiting = r1.commit("last")
        gathering_tags(d)
        save_rank(r0, d.root / "last" / "r0.pt", 2)
        with pytest.raises(CommitError, match="refused"):
            r0.commit("last").result(timeout=120)
        with pytest.raises(CommitError, match="rank 0"):
            waiting.result(timeout=120)
        commit_both(d, r0, r1, 3)


def committed_steps(root: Path, tag: str) -> dict[str, int]:
    """Per file the tag's marker lists, the step it holds (none while the tag was never committed)."""
    if not (root / tag / marker_name(tag)).exists():
        return {}
    return {name: datastates.load(root / tag / name)["step"] for name in marker_files(root, tag)}


def wait_asked(d: DaemonProc, path: Path) -> None:
    """Once the COMMIT sent just now of the snapshot of ``path`` has reached the daemon (a hang guard)."""
    for _ in range(1200):
        if all(s["commit"] != "open" for s in daemon_status(d.endpoint)["snapshots"] if s["path"] == str(path)):
            return
        time.sleep(0.05)
    raise AssertionError(f"the daemon never took the commit of {path}")


def test_a_rank_whose_snapshot_came_after_its_rounds_failure_is_handed_it(start_daemon: Callable[..., DaemonProc]) -> None:
    """Rolling tag ``last``, never committed, two rank processes. Rank 0's step-1 snapshot fails to write (its
    folder is a file), then rank 1 saves step 1, and rank 0's commit is told the round failed. Rank 1's commit of
    step 1 is told the same failure, at once, though its snapshot came after it: nothing tells its step from the
    next one's. Rank 0 then saves step 2 and commits, then rank 1: both are told committed, for step 2's files only.
    Were rank 1's step-1 commit put in a round of its own, rank 0's step-2 commit would join it and both ranks
    would be told committed for a marker of rank 0's step 2 and rank 1's step 1."""
    d = start_daemon(commit_timeout=600)  # a rank that waited for commit_timeout would hang the test past its own
    blocked = d.root / "last" / "rank0"
    blocked.parent.mkdir()
    blocked.write_text("a file where rank 0's folder goes")
    paths = [blocked / "state.pt", d.root / "last" / "rank1" / "state.pt"]
    with rank_procs(d, "last") as (r0, r1):
        assert r0.ask(f"save {paths[0]} 1").startswith("SnapshotFailedError")
        assert r1.ask(f"save {paths[1]} 1") == "OK"
        told = r0.ask("commit")
        assert told.startswith("CommitError") and "rank0" in told, told
        r1.send("commit")
        wait_asked(d, paths[1])
        blocked.unlink()
        assert r0.ask(f"save {paths[0]} 2") == "OK"
        r0.send("commit")
        told = r1.told()
        steps = committed_steps(d.root, "last")
        assert len(set(steps.values())) <= 1, f"rank 1 told {told!r} while the marker lists the steps {steps}"
        assert told.startswith("CommitError") and "rank0" in told, told
        assert r1.ask(f"save {paths[1]} 2") == "OK"
        assert r1.ask("commit") == "OK"
        assert r0.told() == "OK"
    assert committed_steps(d.root, "last") == {"rank0/state.pt": 2, "rank1/state.pt": 2}


def test_a_rank_told_its_round_failed_leaves_no_new_version_behind(start_daemon: Callable[..., DaemonProc]) -> None:
    """``last`` is committed; rank 1 saves it again (a new version, staged beside it), then rank 0's snapshot is
    refused and rank 1's commit is told the round failed: that version is removed, not left staged."""
    d = start_daemon(commit_timeout=600)
    with rank_client(d, 0, 2, 2, 1) as r0, rank_client(d, 1, 2, 2, 1) as r1:
        commit_both(d, r0, r1, 1)
        save_rank(r1, d.root / "last" / "r1.pt", 2)
        assert [p.name for p in d.root.iterdir() if p.name.endswith(".dsgen")]  # the case under test: it was staged
        r0.snapshot(step_state(2), d.root / "last" / "r1.pt", tag="last")
        with pytest.raises(PathNotAllowedError):
            r0.wait()
        with pytest.raises(CommitError, match="rank 0"):
            r1.commit("last").result(timeout=120)
        assert [p.name for p in d.root.iterdir() if p.name.endswith(".dsgen")] == []
        assert datastates.load(d.root / "last" / "r1.pt")["step"] == 1  # the committed version stands
