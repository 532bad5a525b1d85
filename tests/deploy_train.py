"""A tiny training script for deploy/torchrun.sh in tests/test_deploy.py (not a test itself).

Each rank connects to the daemon the script started (through $DATASTATES_ENDPOINT), snapshots
a small state of its own to ROOT/step1/rank{RANK}.pt and commits "step1" (every rank commits
the tag, as a commit over all the job's ranks needs). ``--fail N`` makes rank 1 exit with
status N instead, after its snapshot, to check that the script passes torchrun's failure on.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from datastates.client import Client


def state_for(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {"rank": rank, "weight": torch.randn(256, 64, generator=g), "bias": torch.full((64,), float(rank))}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--fail", type=int, default=0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    assert os.environ["DATASTATES_ENDPOINT"].startswith("ipc://"), "the script exports the daemon's endpoint"
    with Client(timeout=60) as client:
        client.snapshot(state_for(rank), os.path.join(args.root, "step1", f"rank{rank}.pt"))
        client.wait()
        if args.fail and rank == 1:
            print(f"rank {rank}: failing with status {args.fail} as asked", file=sys.stderr)
            return args.fail
        client.commit("step1").result(timeout=120)
    print(f"rank {rank}: step1 committed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
