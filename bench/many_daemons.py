"""Many daemons in one job, as the nodes of a multi-node job on one shared file system.

Why: in a job of N nodes each node's daemon writes a done marker beside the tag's files
and node 0 gathers them before it writes the tag's marker, all through the shared file
system, whose metadata server is the scarcest resource of a large cluster. This measures,
for each N, what a commit costs as N grows: the latency from the last rank's ``commit()``
to every rank's future resolved, and the metadata operations (open, stat, listing, rename,
unlink, mkdir, fsync) a commit costs, node 0's and all nodes', as each daemon counts them
itself (status ``daemon.metadata_ops``); with ``--strace``, node 0's are checked against
``strace -c -f``. Each daemon is its own node (its own endpoint, node rank and small pool)
with one rank, a few KiB of state, all under one root.

Reference in the same run: the floor of one marker's write on the same file system
(create, write, fsync, rename, fsync of the folder), and N of them one after the other.

    .venv/bin/python bench/many_daemons.py --nodes 1,4,16 --rounds 6 --strace
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median
from datastates.client import Client, daemon_status
from datastates.protocol.descriptors import Ranks

STRACE = {"open": ("openat", "open"), "stat": ("newfstatat", "statx", "stat", "lstat"),
          "list": ("getdents64",), "rename": ("rename", "renameat", "renameat2"),
          "unlink": ("unlink", "unlinkat", "rmdir"), "mkdir": ("mkdir", "mkdirat"), "fsync": ("fsync", "fdatasync")}
"""strace's system calls for each of the daemon's own categories (status ``daemon.metadata_ops``, daemon/fsops.py).
A listing is two getdents64 calls or more (the last one returns nothing), and glibc makes ``fstat`` a
``newfstatat`` of the descriptor, which the daemon does not count: those two rows are higher in strace."""


def ops(endpoint: str) -> dict[str, int]:
    return daemon_status(endpoint)["daemon"]["metadata_ops"]


def minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def marker_floor(folder: str) -> float:
    """Seconds of one small file made durable and renamed into place, its folder fsynced: a marker's floor."""
    t0 = time.perf_counter()
    tmp, final = os.path.join(folder, ".m.tmp"), os.path.join(folder, "m")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, b"x" * 512)
    os.fsync(fd)
    os.close(fd)
    os.rename(tmp, final)
    dfd = os.open(folder, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    return time.perf_counter() - t0


def strace_counts(path: str) -> dict[str, int]:
    """``strace -c``'s table: calls per system call."""
    counts: dict[str, int] = {}
    for line in open(path):
        cells = line.split()
        if len(cells) >= 5 and re.fullmatch(r"[\d.]+", cells[0]) and cells[-1] != "total":
            counts[cells[-1]] = int(cells[3])
    return counts


def one_size(nodes: int, rounds: int, kib: int, trace: bool, root: str) -> dict[str, float]:
    shared = os.path.join(root, f"n{nodes}")
    os.makedirs(shared)
    config = {"host_memory": "64MiB", "chunk_size": "4MiB", "memory_restore": "none"}
    with contextlib.ExitStack() as stack:
        endpoints = [stack.enter_context(datastatesd(shared, **config)) for _ in range(nodes)]
        clients = [stack.enter_context(Client(ep, timeout=600, ranks=Ranks(
            rank=i, local_rank=0, world_size=nodes, local_world_size=1, node_rank=i, num_nodes=nodes, job="many")))
            for i, ep in enumerate(endpoints)]
        states = [{"w": torch.randn(kib * 256), "rank": i} for i in range(nodes)]
        pool = stack.enter_context(ThreadPoolExecutor(nodes))
        tracer = None
        if trace:
            out = os.path.join(root, f"strace{nodes}.txt")
            pid = daemon_status(endpoints[0])["daemon"]["pid"]
            tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", out], stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached to every thread
        latencies = []
        before = [ops(ep) for ep in endpoints]
        idle = time.perf_counter()
        for r in range(rounds):
            tag = f"step{r}"
            list(pool.map(lambda i: clients[i].snapshot(states[i], os.path.join(shared, tag, f"rank{i}.pt"), tag=tag),
                          range(nodes)))
            list(pool.map(lambda c: c.wait(), clients))
            futures = [c.commit(tag) for c in clients]
            asked = time.perf_counter()
            for f in futures:
                f.result(timeout=600)
            latencies.append(time.perf_counter() - asked)
        busy = time.perf_counter() - idle
        counted = [minus(ops(ep), b) for ep, b in zip(endpoints, before)]
        calls: dict[str, int] = {}
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(60)
            calls = strace_counts(out)
    traced = {k: sum(calls.get(name, 0) for name in names) for k, names in STRACE.items()}
    return {"latency": median(latencies), "latency_max": max(latencies), "seconds": busy,
            "node0": sum(counted[0].values()) / rounds, "all": sum(sum(c.values()) for c in counted) / rounds,
            "node0_by": {k: v / rounds for k, v in counted[0].items()},
            "traced": {k: v / rounds for k, v in traced.items()} if calls else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,4,16", help="comma-separated numbers of daemons (default 1,4,16)")
    ap.add_argument("--rounds", type=int, default=6, help="commits per size (default 6)")
    ap.add_argument("--kib", type=int, default=64, help="KiB of state per rank (default 64)")
    ap.add_argument("--strace", action="store_true", help="count node 0's system calls with strace -c -f")
    args = ap.parse_args()
    if args.strace and shutil.which("strace") is None:
        ap.error("--strace needs strace")
    root = tempfile.mkdtemp(prefix="ds-many-", dir="/var/tmp")
    try:
        floors = [marker_floor(root) for _ in range(10)]
        floor = median(floors)
        rows = {}
        for n in [int(x) for x in args.nodes.split(",")]:
            rows[n] = one_size(n, args.rounds, args.kib, args.strace, root)
            row = rows[n]
            print(f"N={n}: commit latency median {row['latency']:.3f} s (max {row['latency_max']:.3f}); metadata "
                  f"operations a commit, counted by the daemons: node 0 {row['node0']:.0f}, all nodes {row['all']:.0f}",
                  flush=True)
            print("      node 0: " + ", ".join(f"{k} {v:.1f}" for k, v in row["node0_by"].items()), flush=True)
            if row["traced"]:
                print("      strace: " + ", ".join(f"{k} {v:.1f}" for k, v in row["traced"].items()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows[min(rows)]["latency"]
    print(f"\nmarker floor (create, write, fsync, rename, fsync folder): {floor * 1000:.2f} ms")
    print(f"{'N':>4} {'latency s':>10} {'- N=' + str(min(rows)):>9} {'/ floor':>8} {'/ N floors':>11}"
          f" {'node0 ops':>10} {'per node':>9} {'all ops':>8} {'per node':>9}")
    for n, row in rows.items():
        print(f"{n:>4} {row['latency']:>10.3f} {row['latency'] - base:>9.3f} {row['latency'] / floor:>8.1f} "
              f"{row['latency'] / (n * floor):>11.2f} {row['node0']:>10.0f} {row['node0'] / n:>9.1f} "
              f"{row['all']:>8.0f} {row['all'] / n:>9.1f}")


if __name__ == "__main__":
    main()
