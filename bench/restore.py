"""Restore time after a trainer crash: from the daemon's memory against storage, torch.load and DCP.

Why: most faults are a dead trainer on a healthy node, and the restart's first cost is
reading the checkpoint back. One GPT-shaped state is checkpointed once by each contender;
then, per run, with a cold page cache each time (root only; warned otherwise):

- memory: ``Client.restore`` served from the daemon's replica (/dev/shm);
- storage: ``datastates.load`` of the same committed file on disk;
- torch.load: of a ``torch.save`` file of the same state;
- DCP: ``torch.distributed.checkpoint.load`` into a preallocated state.

Every restore touches each page of what it loaded. It prints medians over ``--runs``
(contenders interleaved) and the ratios memory / peer.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, drop_caches, fsync_tree, gpt_state, print_medians, state_bytes, tensors_of, timed  # noqa: E402

import datastates  # noqa: E402
from datastates.client import Client  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def touch(state: Any) -> None:
    for t in tensors_of(state):
        if t.numel():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir)")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="ds-bench-restore-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    state = gpt_state(layers=args.layers, dim=args.dim)
    nbytes = state_bytes(state)
    print(f"state: {nbytes / 1e9:.2f} GB in {len(tensors_of(state))} tensors; {args.runs} runs; root {root}")
    try:
        with datastatesd(root, host_memory="1GiB", memory_restore_budget=f"{nbytes * 2 // (1 << 20) + 64}MiB") as ep:
            with Client(ep, timeout=600) as client:
                client.snapshot(state, os.path.join(root, "step1", "rank0.pt"))
                client.wait()
                client.commit("step1").result()
                os.makedirs(os.path.join(root, "ts"))
                torch.save(state, os.path.join(root, "ts", "rank0.pt"))
                dcp.save({"state": state}, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
                fsync_tree(root)
                template = {"state": copy.deepcopy(state)}  # DCP loads in place, into preallocated tensors

                def dcp_load() -> Any:
                    dcp.load(template, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
                    return template

                def memory() -> Any:
                    restored = client.restore(root, "rank0.pt")
                    assert restored is not None and restored.source == "memory", restored
                    return restored.state

                contenders: dict[str, Callable[[], Any]] = {
                    "memory": memory,
                    "storage": lambda: datastates.load(os.path.join(root, "step1", "rank0.pt")),
                    "torch.load": lambda: torch.load(os.path.join(root, "ts", "rank0.pt"), weights_only=False),
                    "dcp": dcp_load,
                }
                times: dict[str, list[float]] = {n: [] for n in contenders}
                for r in range(args.runs):
                    for name, fn in contenders.items():
                        gc.collect()  # the previous contender's state is freed here, not inside the next timing
                        drop_caches()
                        seconds, _ = timed(lambda: touch(fn()))
                        times[name].append(seconds)
                        del _
                    print(f"run {r + 1}/{args.runs}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
                          flush=True)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    med = print_medians(times, nbytes)
    for peer in ("storage", "torch.load", "dcp"):
        print(f"restore time: memory / {peer:<11} {med['memory'] / med[peer]:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
