"""The daemon's CPU per checkpoint: what it takes from a trainer on the same cores.

Why: on a node whose cores the trainer keeps busy, every CPU-second the daemon spends
copying, checksumming and writing is taken from training (``bench/train_overhead.py``
shows the slowdown; this shows the cause). A trainer with a 0.76 GB model + fused AdamW
state (the state ``train_overhead.py`` checkpoints) snapshots, waits and commits
``--checkpoints`` times through a real daemon; the daemon's CPU time (user + system, all
threads, from /proc) over those checkpoints is divided by their number. One line per
``memory_restore`` policy named, so the replica's share shows: ``latest`` writes each
snapshot a second time, into /dev/shm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, state_bytes  # noqa: E402

from datastates.client import Client, daemon_status  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid`` so far, every thread."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def training_state(width: int = 2816, layers: int = 8) -> dict:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(8, width)).sum().backward()
    opt.step()  # AdamW makes its state on the first step
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--policies", default="latest,none", help="memory_restore policies to measure (default latest,none)")
    args = ap.parse_args()
    state = training_state()
    nbytes = state_bytes(state)
    root = tempfile.mkdtemp(prefix="ds-bench-cpu-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    print(f"state {nbytes / 1e9:.2f} GB; {args.checkpoints} checkpoints per policy; root {root}")
    try:
        for policy in args.policies.split(","):
            measure(state, nbytes, root, policy, args.checkpoints)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def measure(state: dict, nbytes: int, root: str, policy: str, checkpoints: int) -> None:
    """One daemon with ``memory_restore: policy``: its CPU over ``checkpoints`` checkpoints, per checkpoint."""
    with datastatesd(root, memory_restore=policy) as endpoint, Client(endpoint, timeout=600) as client:
        pid = daemon_status(endpoint)["daemon"]["pid"]
        checkpoint(client, state, root, "warm")  # the first one maps the pool's chunks
        time.sleep(1)
        before, t0 = cpu_seconds(pid), time.perf_counter()
        for i in range(checkpoints):
            checkpoint(client, state, root, f"s{i}")
        wall = (time.perf_counter() - t0) / checkpoints
        time.sleep(0.5)  # the last commit's tail (a replica's old file freed)
        cpu = (cpu_seconds(pid) - before) / checkpoints
    print(f"memory_restore={policy:<7} daemon CPU per checkpoint {cpu:6.3f} s ({cpu / wall:4.2f} cores busy "
          f"over the {wall:.3f} s a checkpoint took, {nbytes / cpu / 1e9:.2f} GB per CPU-second)")


def checkpoint(client: Client, state: dict, root: str, tag: str) -> None:
    client.snapshot(state, os.path.join(root, tag, "m.pt"), tag=tag)
    client.wait()
    client.commit(tag).result()


if __name__ == "__main__":
    sys.exit(main())
