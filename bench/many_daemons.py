"""Many daemons in one job, as the nodes of a multi-node job on one shared file system (issue 31, part 2).

Why: in a job of N nodes each node's daemon writes a done marker beside the tag's files
and node 0 gathers them before it writes the tag's marker, all through the shared file
system, whose metadata server is the scarcest resource of a large cluster. This measures,
for each N, what a commit costs as N grows: the latency from the last rank's ``commit()``
to every rank's future resolved, and (``--strace``) the system calls node 0's daemon
makes for the commits, counted by ``strace -c -f``. Each daemon is its own node (its own
endpoint, node rank and small pool) with one rank, a few KiB of state, all under one root.

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

METADATA = ("openat", "open", "stat", "newfstatat", "statx", "lstat", "fstat", "getdents64", "rename", "renameat",
            "renameat2", "unlink", "unlinkat", "mkdir", "mkdirat", "fsync", "fdatasync")
"""The system calls counted as file-system metadata operations (fsync counts: of a folder it is one)."""


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
        calls: dict[str, int] = {}
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(60)
            calls = strace_counts(out)
    meta = sum(calls.get(name, 0) for name in METADATA)
    return {"latency": median(latencies), "latency_max": max(latencies), "meta_per_commit": meta / rounds,
            "calls_per_commit": sum(calls.values()) / rounds, "seconds": busy, "counts": calls}


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
            print(f"N={n}: commit latency median {rows[n]['latency']:.3f} s (max {rows[n]['latency_max']:.3f})"
                  + (f", node 0: {rows[n]['meta_per_commit']:.0f} metadata calls a commit "
                     f"({rows[n]['calls_per_commit']:.0f} calls in all)" if args.strace else ""), flush=True)
            if args.strace:
                top = sorted(((v, k) for k, v in rows[n]["counts"].items() if k in METADATA), reverse=True)[:8]
                print("      " + ", ".join(f"{k} {v / args.rounds:.0f}" for v, k in top), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = rows[min(rows)]["latency"]
    print(f"\nmarker floor (create, write, fsync, rename, fsync folder): {floor * 1000:.2f} ms")
    print(f"{'N':>4} {'latency s':>10} {'- N=' + str(min(rows)):>9} {'/ floor':>8} {'/ N floors':>11}"
          + (f" {'node0 meta/commit':>18} {'per node':>9}" if args.strace else ""))
    for n, row in rows.items():
        print(f"{n:>4} {row['latency']:>10.3f} {row['latency'] - base:>9.3f} {row['latency'] / floor:>8.1f} "
              f"{row['latency'] / (n * floor):>11.2f}"
              + (f" {row['meta_per_commit']:>18.0f} {row['meta_per_commit'] / n:>9.1f}" if args.strace else ""))


if __name__ == "__main__":
    main()
