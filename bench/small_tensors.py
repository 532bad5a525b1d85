"""A state of many tiny tensors: what each part of a checkpoint costs per tensor.

Why: a checkpoint's cost should follow its bytes, but a state of 100,000 tensors of 4
elements (a model's many small biases and norms, an optimizer's per-parameter steps, a
sharded state's small shards) is dominated by the per-tensor work of the client and the
daemon. The targets: ``snapshot()`` within 1 s and ``wait()`` (the trainer may change its
tensors) within 2 s, where ``torch.save`` took 3 s.

Each round takes, against one daemon already running with its pool mapped: the call
(``snapshot()``), the fence (``wait()`` right after it: the time until the bytes are
copied), and durable (the commit's answer). Reference points in the same run:
``torch.save`` of the same state (fsynced), ``dcp.save`` (one process, one thread) and a
raw write of the same number of bytes (``--raw``: the bytes are few, so it is the floor
of one file's create, write, fsync and rename).

    .venv/bin/python bench/small_tensors.py --tensors 100000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median, state_bytes, wait_pool_mapped
from datastates.client import Client


def fsynced_save(state: dict[str, torch.Tensor], path: str) -> float:
    t0 = time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t0


def raw_write(nbytes: int, path: str) -> float:
    data = os.urandom(nbytes)
    t0 = time.perf_counter()
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    os.rename(path + ".tmp", path)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=100_000)
    ap.add_argument("--elements", type=int, default=4, help="float32 elements per tensor (default 4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-dcp", action="store_true", help="skip dcp.save (slow at this many tensors)")
    args = ap.parse_args()
    state = {f"t{i}": torch.randn(args.elements) for i in range(args.tensors)}
    nbytes = state_bytes(state)
    root = tempfile.mkdtemp(prefix="ds-small-", dir="/var/tmp")
    calls, fences, durables, saves, dcps, raws = [], [], [], [], [], []
    try:
        with datastatesd(os.path.join(root, "ds")) as endpoint, Client(endpoint, timeout=600) as c:
            wait_pool_mapped(endpoint)
            for r in range(args.rounds):
                saves.append(fsynced_save(state, os.path.join(root, "torch.pt")))
                os.unlink(os.path.join(root, "torch.pt"))
                raws.append(raw_write(nbytes, os.path.join(root, "raw")))
                if not args.no_dcp:
                    t0 = time.perf_counter()
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(root, f"dcp{r}"), thread_count=1),
                             no_dist=True)
                    dcps.append(time.perf_counter() - t0)
                    shutil.rmtree(os.path.join(root, f"dcp{r}"))
                tag = f"s{r}"
                t0 = time.perf_counter()
                c.snapshot(state, os.path.join(root, "ds", tag, "rank0.pt"), tag=tag)
                t1 = time.perf_counter()
                c.wait()
                t2 = time.perf_counter()
                c.commit(tag).result()
                t3 = time.perf_counter()
                calls.append(t1 - t0)
                fences.append(t2 - t1)
                durables.append(t3 - t0)
                print(f"round {r}: snapshot() {calls[-1]:.2f} s, wait() {fences[-1]:.2f} s, durable {durables[-1]:.2f} s;"
                      f" torch.save {saves[-1]:.2f} s" + (f", dcp.save {dcps[-1]:.2f} s" if dcps else "")
                      + f", raw write {raws[-1]:.4f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save = median(saves)
    print(f"\nmedians of {args.rounds} rounds, {args.tensors} tensors of {args.elements} elements ({nbytes / 1e6:.1f} MB):")
    rows = [("torch.save (fsynced)", saves)] + ([("dcp.save (1 thread)", dcps)] if dcps else []) + [
        ("raw write of the bytes", raws), ("snapshot()", calls), ("wait() after it", fences),
        ("snapshot() + wait()", [a + b for a, b in zip(calls, fences)]), ("durable (commit answered)", durables)]
    for name, xs in rows:
        print(f"  {name:<27} {median(xs):7.3f} s   {median(xs) / save:6.3f} x torch.save"
              + (f"   {median(xs) / median(dcps):6.3f} x dcp.save" if dcps else ""))


if __name__ == "__main__":
    main()
