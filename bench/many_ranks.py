"""Many ranks on one daemon, and two daemons of eight ranks each, as the nodes of one job.

Why: a node of a training cluster runs 8 ranks, each checkpointing at the same step, and
one daemon serves them all from one host pool. This runs that for real: ``--ranks`` rank
processes per node (each a ``Client`` with its place in the job, ``--mib`` MiB of CPU
tensors), against ``--nodes`` daemons writing under one shared root, and reports:

- **fairness**: each rank's fence (``wait()`` before its optimizer step) after a save,
  its p95 over the saves against the median rank's; and, from each snapshot's timings in
  the daemon's status (``queued_s``, ``copied_s``), how many other ranks' snapshots were
  copied whole between a snapshot's arrival and its first byte copied (chunks and copy
  threads go in turns between ranks: at most one);
- **the budget**: each daemon's memory (its own resident pages and its replicas' in
  /dev/shm), every 20 ms, against ``host_memory`` + ``memory_restore_budget`` + 256 MiB;
- **throughput**: every rank snapshots at once, waits and commits; the node's durable bytes
  a second (first ``snapshot()`` to the last commit resolved) against a raw O_DIRECT
  write of the same bytes, and against every rank's ``torch.save`` (fsynced) and
  ``dcp.save`` at once, all in the same run, medians of ``--bursts``;
- **a rank killed**: ``kill -9`` of one rank while the daemon copies its snapshot; every
  rank's commit of that tag must raise, and once a new process takes its place the job's
  next tag commits, each rank's file bitwise its state.

The "compute" between checkpoints is a sleep: on a GPU node the CPU is idle then, and
a CPU-bound stand-in would only measure 2 cores shared by 8 ranks.

    .venv/bin/python bench/many_ranks.py                 # 8 ranks, one daemon
    .venv/bin/python bench/many_ranks.py --nodes 2       # 2 daemons x 8 ranks
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import warnings
from contextlib import ExitStack
from multiprocessing.connection import Connection
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median, raw_write, wait_pool_mapped  # noqa: E402

RSS_HEADROOM = 256 << 20
"""What the daemon may hold beyond its pool and its replicas: its code, torch, the status and the plans."""


def rank_main(conn: Connection, endpoint: str, root: str, rank: int, ranks_per_node: int, nodes: int, mib: int,
              seed: int) -> None:
    """One trainer rank: a state of ``mib`` MiB in 8 tensors, driven step by step by the driver's messages."""
    import torch
    import torch.distributed.checkpoint as dcp

    import datastates
    from datastates.client import Client
    from datastates.protocol.descriptors import Ranks

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    g = torch.Generator().manual_seed(seed)
    state: dict[str, Any] = {f"layer{i}": torch.randn(mib << 15, generator=g) for i in range(8)}
    state["step"] = 0
    places = Ranks(rank=rank, local_rank=rank % ranks_per_node, world_size=ranks_per_node * nodes,
                   local_world_size=ranks_per_node, node_rank=rank // ranks_per_node, num_nodes=nodes, job="many")
    futures: dict[str, Any] = {}
    with Client(endpoint, timeout=600, ranks=places) as client:
        conn.send(("ready", os.getpid()))
        while True:
            cmd, *args = conn.recv()
            if cmd == "step":  # forward and backward, the fence, the optimizer step, a save on some steps
                compute_s, tag = args
                time.sleep(compute_s)
                t0 = time.perf_counter()
                client.wait()
                fence = time.perf_counter() - t0
                for name, t in state.items():
                    if name != "step":
                        t[0] += 1.0  # the optimizer changes the state the next save holds
                state["step"] += 1
                snapshot = 0.0
                if tag:
                    t0 = time.perf_counter()
                    client.snapshot(state, os.path.join(root, tag, f"rank{rank}.pt"), tag=tag)
                    snapshot = time.perf_counter() - t0
                    futures[tag] = client.commit(tag)
                conn.send((fence, snapshot))
            elif cmd == "drain":
                errors = {}
                for tag, fut in futures.items():
                    try:
                        fut.result(timeout=1200)
                    except Exception as exc:  # reported to the driver, which decides
                        errors[tag] = f"{type(exc).__name__}: {exc}"
                futures.clear()
                conn.send(errors)
            elif cmd == "burst":  # every rank at once: snapshot, wait, commit, durable
                (tag,) = args
                t0 = time.monotonic()
                client.snapshot(state, os.path.join(root, tag, f"rank{rank}.pt"), tag=tag)
                client.wait()
                try:
                    client.commit(tag).result(timeout=1200)
                    conn.send((t0, time.monotonic(), ""))
                except Exception as exc:
                    conn.send((t0, time.monotonic(), f"{type(exc).__name__}: {exc}"))
            elif cmd == "torch.save":
                (path,) = args
                t0 = time.monotonic()
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                conn.send((t0, time.monotonic(), ""))
            elif cmd == "dcp.save":
                (path,) = args
                t0 = time.monotonic()
                dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=1), no_dist=True)
                conn.send((t0, time.monotonic(), ""))
            elif cmd == "verify":
                (path,) = args
                loaded = datastates.load(path)
                bad = [k for k, t in state.items() if k != "step" and not torch.equal(loaded[k], t)]
                conn.send(bad + ([] if loaded["step"] == state["step"] else ["step"]))
            elif cmd == "quit":
                conn.send("bye")
                return


class Rank:
    def __init__(self, ctx: Any, endpoint: str, root: str, rank: int, args: argparse.Namespace) -> None:
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(child, endpoint, root, rank, args.ranks, args.nodes, args.mib,
                                                        rank), daemon=True)
        self.proc.start()
        self.pid = 0

    def ready(self) -> None:
        what, self.pid = self.conn.recv()
        assert what == "ready"

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.conn.recv()


def all_ask(ranks: list[Rank], *cmd: Any, per_rank: Any = None) -> list[Any]:
    """``cmd`` sent to every rank at once (``per_rank(rank)`` appended, where given); their answers."""
    for r in ranks:
        r.conn.send(cmd + ((per_rank(r.rank),) if per_rank else ()))
    return [r.conn.recv() for r in ranks]


class Sampler:
    """The daemons' resident memory (every 20 ms, in a thread), and their snapshots' timings (``read_jobs``)."""

    def __init__(self, endpoints: list[str], pids: list[int]) -> None:
        from datastates.client import daemon_status

        self.endpoints, self.pids = endpoints, pids
        self.folders = [daemon_status(ep)["replicas"]["folder"] for ep in endpoints]
        self.rss = [0] * len(pids)
        """Peak memory the daemon holds: its own (anonymous, and files) and its replicas' in /dev/shm, once each."""
        self.vmrss = [0] * len(pids)
        """Peak VmRSS: higher, as a replica mapped twice (locked, and filled in place) counts twice there."""
        self.parts: list[dict[str, int]] = [{} for _ in pids]  # RssAnon, RssFile, RssShmem at the peak
        self.events: dict[tuple[int, int], dict[str, Any]] = {}  # (node, job id) -> arrival, first copied, whole
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._rss, daemon=True)]
        for t in self._threads:
            t.start()

    def _rss(self) -> None:
        while not self._stop.wait(0.02):
            for i, pid in enumerate(self.pids):
                with open(f"/proc/{pid}/status") as f:
                    kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k.startswith("Rss")
                          or k == "VmRSS"}
                held = (kb["RssAnon"] + kb["RssFile"]) * 1024 + folder_bytes(self.folders[i])
                self.vmrss[i] = max(self.vmrss[i], kb["VmRSS"] * 1024)
                if held > self.rss[i]:
                    self.rss[i], self.parts[i] = held, {k: v * 1024 for k, v in kb.items() if k != "VmRSS"}

    def read_jobs(self) -> None:
        """Each snapshot's arrival, first bytes copied and last, as the daemons timed them (status keeps the last 256)."""
        from datastates.client import daemon_status

        for node, endpoint in enumerate(self.endpoints):
            now = time.monotonic()
            for job in daemon_status(endpoint, timeout=30)["snapshots"]:
                if job["queued_s"] is not None and job["copied_s"] is not None:
                    seen = now - job["since_s"]
                    self.events[(node, job["id"])] = {"node": node, "seen": seen, "first": seen + job["queued_s"],
                                                      "whole": seen + job["copied_s"], "queued": job["queued_s"],
                                                      "path": job["path"]}

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def waited_behind(self, later: bool = False) -> list[int]:
        """For each snapshot (``later``: but each file's first), how many others of its node were copied whole between
        its arrival and its first byte."""
        jobs = sorted(self.events.values(), key=lambda e: e["seen"])
        def rank_file(j: dict[str, Any]) -> tuple[str, str]:  # as the daemon's replicas tell files apart
            return os.path.dirname(os.path.dirname(j["path"])), os.path.basename(j["path"])

        firsts = {id(next(j for j in jobs if rank_file(j) == f)) for f in {rank_file(j) for j in jobs}}
        return [sum(1 for o in jobs if o is not j and o["node"] == j["node"] and j["seen"] < o["whole"] < j["first"])
                for j in jobs if not (later and id(j) in firsts)]


def folder_bytes(folder: str) -> int:
    """Bytes of memory the files in ``folder`` (on /dev/shm) take."""
    total = 0
    with os.scandir(folder) as entries:
        for e in entries:
            try:
                total += e.stat(follow_symlinks=False).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def spread(answers: list[tuple[float, float, str]]) -> float:
    """Seconds from the first rank's start to the last rank's end."""
    bad = [a[2] for a in answers if a[2]]
    assert not bad, bad
    return max(a[1] for a in answers) - min(a[0] for a in answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument("--nodes", type=int, default=1, help="daemons, each a node of the job (default 1)")
    ap.add_argument("--mib", type=int, default=256, help="MiB of state per rank (default 256)")
    ap.add_argument("--steps", type=int, default=12, help="training steps (default 12)")
    ap.add_argument("--every", type=int, default=3, help="a checkpoint every N steps (default 3)")
    ap.add_argument("--compute-s", type=float, default=1.0, help="seconds of forward and backward a step (default 1)")
    ap.add_argument("--bursts", type=int, default=3, help="runs of each throughput contender (default 3)")
    ap.add_argument("--host-memory", default="2GiB", help="each daemon's host_memory (default 2GiB, the default)")
    ap.add_argument("--restore-budget", default="2GiB", help="each daemon's memory_restore_budget (default 2GiB)")
    ap.add_argument("--no-replicas", action="store_true", help="memory_restore: none (default: latest, the default)")
    ap.add_argument("--commit-timeout", type=float, default=60,
                    help="each daemon's commit_timeout: how long the other nodes' ranks wait for a killed rank's node "
                         "(default 60)")
    args = ap.parse_args()
    if args.ranks * args.nodes < 2:
        ap.error("a job of 2 ranks at least: one of them is killed")
    from datastates.client import daemon_status
    from datastates.daemon.config import parse_size

    budget = parse_size(args.host_memory, "host_memory") + parse_size(args.restore_budget, "restore") + RSS_HEADROOM
    world = args.ranks * args.nodes
    total = world * args.mib << 20
    root = tempfile.mkdtemp(prefix="ds-ranks-", dir="/var/tmp")
    ctx = mp.get_context("spawn")
    try:
        with ExitStack() as stack:
            endpoints = [stack.enter_context(datastatesd(
                root, host_memory=args.host_memory, commit_timeout=args.commit_timeout,
                memory_restore="none" if args.no_replicas else "latest", memory_restore_budget=args.restore_budget))
                         for _ in range(args.nodes)]
            pids = [daemon_status(ep)["daemon"]["pid"] for ep in endpoints]
            for ep in endpoints:
                wait_pool_mapped(ep)  # as at a job's first checkpoint, minutes after its daemons started
            ranks = [Rank(ctx, endpoints[r // args.ranks], root, r, args) for r in range(world)]
            for r in ranks:
                r.ready()
            stack.callback(lambda: [r.proc.kill() for r in ranks])
            print(f"{world} ranks of {args.mib} MiB on {args.nodes} daemon(s), {total / 1e9:.2f} GB a checkpoint",
                  flush=True)
            sampler = Sampler(endpoints, pids)

            # 1. Training: fences and snapshot calls, the sampler watching; the daemons' metadata operations.
            ops_before = [daemon_status(ep)["daemon"]["metadata_ops"] for ep in endpoints]
            fences: dict[int, list[float]] = {r: [] for r in range(world)}
            rounds: list[list[float]] = []
            snaps: list[float] = []
            saved_at = 0
            for step in range(1, args.steps + 2):  # one more step: the fence after the last save
                tag = f"global_step{step}" if step % args.every == 0 and step <= args.steps else ""
                answers = all_ask(ranks, "step", args.compute_s, tag)
                if saved_at:  # the fence right after a save: the one that may block
                    for r, (fence, _) in enumerate(answers):
                        fences[r].append(fence)
                    rounds.append([a[0] for a in answers])
                    saved_at = 0
                if tag:
                    saved_at = step
                    snaps += [a[1] for a in answers]
            errors = all_ask(ranks, "drain")
            assert not any(errors), errors
            sampler.read_jobs()
            saves = args.steps // args.every
            ops = [{k: (v - b[k]) / saves for k, v in daemon_status(ep)["daemon"]["metadata_ops"].items()}
                   for ep, b in zip(endpoints, ops_before)]

            # 2. Throughput: every rank at once, against a raw write, torch.save and dcp.save of the same bytes.
            rates: dict[str, list[float]] = {"datastates durable": [], "torch.save": [], "dcp.save": [],
                                             "raw O_DIRECT": []}
            for run in range(args.bursts):
                rates["datastates durable"].append(spread(all_ask(ranks, "burst", f"burst{run}")))
                rates["torch.save"].append(spread(all_ask(
                    ranks, "torch.save", per_rank=lambda r: os.path.join(root, f"torch-{run}-{r}.pt"))))
                rates["dcp.save"].append(spread(all_ask(
                    ranks, "dcp.save", per_rank=lambda r: os.path.join(root, f"dcp-{run}-{r}"))))
                rates["raw O_DIRECT"].append(raw_write(os.path.join(root, "raw.bin"), total, 2))
                for name in os.listdir(root):
                    if name.startswith(("torch-", "dcp-", "burst")):
                        shutil.rmtree(os.path.join(root, name), ignore_errors=True) if os.path.isdir(
                            os.path.join(root, name)) else os.unlink(os.path.join(root, name))
            sampler.read_jobs()
            sampler.stop()

            # 3. A rank killed mid-snapshot; its restart; the next tag.
            victim = ranks[world // 2 + 1 if world > 2 else 1]
            killed = kill_mid_snapshot(ranks, victim, endpoints[victim.rank // args.ranks], args.ranks)
            ranks[victim.rank] = Rank(ctx, endpoints[victim.rank // args.ranks], root, victim.rank, args)
            ranks[victim.rank].ready()
            after = all_ask(ranks, "burst", "after_kill")
            unequal = [(r.rank, bad) for r in ranks
                       for bad in [r.ask("verify", os.path.join(root, "after_kill", f"rank{r.rank}.pt"))] if bad]
            for r in ranks:
                r.ask("quit")
    finally:
        shutil.rmtree(root, ignore_errors=True)

    med = {k: median(v) for k, v in rates.items()}
    p95s = {r: p95(f) for r, f in fences.items()}
    mid = median(list(p95s.values()))
    behind = sampler.waited_behind()
    print(f"\nfences after a save (s): p95 per rank {min(p95s.values()):.3f}-{max(p95s.values()):.3f}, "
          f"median rank's {mid:.3f}; worst / median {max(p95s.values()) / mid if mid else float('nan'):.2f} "
          f"(hold: <= 2)")
    print("  each save's fences, median and max: " + ", ".join(f"{median(f):.3f}/{max(f):.3f}" for f in rounds))
    print(f"snapshot() calls: median {median(snaps):.3f} s, max {max(snaps):.3f} s")
    queued = [e["queued"] for e in sampler.events.values()]
    later = sampler.waited_behind(later=True)
    print(f"snapshots copied whole ahead of one's first byte: max {max(behind)} over all {len(behind)}, "
          f"max {max(later)} over the {len(later)} that were not their file's first (hold: <= 1); "
          f"time to the first byte copied: median {median(queued):.3f} s, max {max(queued):.3f} s")
    for node, rss in enumerate(sampler.rss):
        print(f"daemon {node} memory, peak: {rss / 2**20:.0f} MiB of {budget / 2**20:.0f} MiB allowed "
              f"({rss / budget:.2f}; hold: <= 1): its own " + ", ".join(f"{k} {v / 2**20:.0f} MiB"
                                                                      for k, v in sampler.parts[node].items())
              + f", and its replicas' files; VmRSS peak {sampler.vmrss[node] / 2**20:.0f} MiB "
                f"(a replica mapped twice counts twice there)")
    for node, per in enumerate(ops):
        print(f"daemon {node} metadata operations a checkpoint ({args.ranks} files): {sum(per.values()):.0f}, "
              f"{sum(per.values()) / args.ranks:.1f} a file: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()))
    print(f"\nevery rank at once, {total / 1e9:.2f} GB, medians of {args.bursts}:")
    for name, seconds in med.items():
        print(f"  {name:<20} {seconds:7.2f} s  {total / seconds / 1e9:5.2f} GB/s")
    print(f"  datastates durable / raw O_DIRECT: {med['raw O_DIRECT'] / med['datastates durable']:.2f} (hold: >= 0.85); "
          f"/ torch.save {med['torch.save'] / med['datastates durable']:.2f}; "
          f"/ dcp.save {med['dcp.save'] / med['datastates durable']:.2f} (rates' ratios)")
    print(f"\nrank {victim.rank} killed mid-snapshot ({killed['copied']} of {killed['total']} bytes copied): "
          f"{killed['raised']} of {world - 1} other ranks' commits raised (hold: all), the last on its node "
          f"{killed['same_s']:.2f} s after the kill" + (f", on the other node(s) {killed['other_s']:.2f} s (their "
          f"commit_timeout, {args.commit_timeout:.0f} s)" if args.nodes > 1 else "") + "; "
          f"the next tag after its restart: {'committed, every file bitwise equal' if not unequal and not any(a[2] for a in after) else f'FAILED {unequal} {[a[2] for a in after]}'}")


def kill_mid_snapshot(ranks: list[Rank], victim: Rank, endpoint: str, per: int) -> dict[str, Any]:
    """Every rank snapshots ``killed``; ``victim`` is killed once the daemon has begun its copy, not finished it; the
    others wait and commit. How many of their commits raised, and the seconds until the last did on the victim's node
    (``per`` ranks a node) and on the others."""
    from datastates.client import daemon_status

    for r in ranks:
        r.conn.send(("burst", "killed"))
    while True:  # the victim's snapshot admitted and part copied
        jobs = [j for j in daemon_status(endpoint)["snapshots"] if j["tag"] == "killed"
                and j["path"].endswith(f"/rank{victim.rank}.pt")]
        if jobs and 0 < jobs[0]["copied_bytes"] < jobs[0]["total_bytes"]:
            break
        time.sleep(0.005)
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.proc.join(30)
    answers = {r.rank: r.conn.recv() for r in ranks if r is not victim}
    same = [a[1] - killed_at for rank, a in answers.items() if rank // per == victim.rank // per]
    other = [a[1] - killed_at for rank, a in answers.items() if rank // per != victim.rank // per]
    return {"copied": jobs[0]["copied_bytes"], "total": jobs[0]["total_bytes"],
            "raised": sum(1 for a in answers.values() if a[2]), "same_s": max(same, default=0.0),
            "other_s": max(other, default=0.0)}


if __name__ == "__main__":
    main()
