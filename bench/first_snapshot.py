"""The first checkpoints of a fresh daemon, against later ones, torch.save and a bare copy.

Why: a trainer usually starts seconds after its daemon, while the daemon still maps its
host pool, and its first snapshot used to wait there (0.75 s at the fence for 1 GiB, a
quarter of a ``torch.save``). Each trial starts a new ``datastatesd`` and, as soon as it
answers, snapshots a state (1 GiB by default), computes for ``--pause`` seconds (the
forward and backward a real step would run), then waits at the fence, as a trainer does
before ``opt.step()``. The trainer is blocked for the call plus the fence. Two more
snapshots follow, a second apart, for the steady state. Reference points are measured in
the same run: ``torch.save`` of the same state to the same disk (fsynced) and a bare
``copy_`` of its bytes into memory already mapped (the least any copy can cost).

Prints, over the trials, the medians of the blocked time of the first and of the later
snapshots, and their ratios to ``torch.save`` and to the bare copy.

    .venv/bin/python bench/first_snapshot.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median, state_bytes
from datastates.client import Client


def blocked(client: Client, state: dict[str, Any], path: str, pause: float) -> tuple[float, float]:
    """(seconds the trainer was blocked: call + fence, seconds from the call until durable) for one checkpoint."""
    tag = os.path.basename(os.path.dirname(path))
    t0 = time.perf_counter()
    client.snapshot(state, path, tag=tag)
    call = time.perf_counter() - t0
    end = time.perf_counter() + pause
    while time.perf_counter() < end:  # busy, as forward and backward keep the cores busy
        pass
    t1 = time.perf_counter()
    client.wait()
    fence = time.perf_counter() - t1
    client.commit(tag).result()
    return call + fence, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="fresh daemons, one after the other (default 5)")
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB, in 16 tensors (default 1)")
    ap.add_argument("--pause", type=float, default=0.1, help="seconds of compute between snapshot() and wait()")
    ap.add_argument("--daemon", action="append", default=[], metavar="KEY=VALUE",
                    help="a node config key for the daemons, e.g. memory_restore=none (repeatable)")
    args = ap.parse_args()
    n = int(args.gib * (1 << 30) / 4 / 16)
    state = {f"w{i}": torch.randn(n) for i in range(16)}
    nbytes = state_bytes(state)
    root = tempfile.mkdtemp(prefix="ds-first-", dir="/var/tmp")
    config = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.daemon)}
    first, later, durable_first, saves, copies = [], [], [], [], []
    try:
        for trial in range(args.trials):
            path = os.path.join(root, "torch.pt")
            t0 = time.perf_counter()
            torch.save(state, path)
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
            saves.append(time.perf_counter() - t0)
            os.unlink(path)
            dst = torch.empty(nbytes, dtype=torch.uint8)
            dst.zero_()
            t0 = time.perf_counter()
            at = 0
            for t in state.values():
                flat = t.view(torch.uint8).view(-1)
                dst[at:at + flat.numel()].copy_(flat)
                at += flat.numel()
            copies.append(time.perf_counter() - t0)
            del dst

            started = time.perf_counter()
            with datastatesd(os.path.join(root, f"t{trial}"), **config) as endpoint, Client(endpoint, timeout=600) as c:
                since = time.perf_counter() - started
                runs = []
                for i in range(3):
                    runs.append(blocked(c, state, os.path.join(root, f"t{trial}", f"s{i}", "rank0.pt"), args.pause))
                    time.sleep(1)
            first.append(runs[0][0])
            durable_first.append(runs[0][1])
            later.append(median([b for b, _ in runs[1:]]))
            print(f"trial {trial}: first snapshot {since:.1f} s after the daemon's start: blocked {runs[0][0]:.3f} s, "
                  f"durable {runs[0][1]:.2f} s; later blocked {later[-1]:.3f} s; torch.save {saves[-1]:.2f} s, "
                  f"bare copy {copies[-1]:.3f} s", flush=True)
            shutil.rmtree(os.path.join(root, f"t{trial}"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save, copy = median(saves), median(copies)
    print(f"\nmedians of {args.trials} trials, {nbytes / 1e9:.2f} GB, pause {args.pause} s:")
    print(f"  torch.save (fsynced)     {save:7.3f} s")
    print(f"  bare copy_ into memory   {copy:7.3f} s")
    for name, xs in (("first snapshot blocked", first), ("later snapshots blocked", later)):
        print(f"  {name:<24} {median(xs):7.3f} s   {median(xs) / save:.3f} x torch.save   "
              f"{median(xs) / copy:.2f} x the bare copy")
    print(f"  first / later blocked    {median(first) / median(later):.2f}")
    print(f"  first snapshot durable   {median(durable_first):7.3f} s   {median(durable_first) / save:.3f} x torch.save")


if __name__ == "__main__":
    main()
