"""A data-parallel job for torchrun: gloo on loopback, a checkpoint of every rank each step.

Usage: torchrun ... multinode_train.py ROOT STEPS. Each rank reaches its node's daemon
through $DATASTATES_ENDPOINT and writes ROOT/global_step<N>/rank<R>.pt; every rank
commits every step, and the daemons commit the tag once all four have.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from datastates.client import Client


def main() -> None:
    root, steps = Path(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    with Client() as ckpt:
        ckpt.protect(opt)
        commits = []
        for step in range(1, steps + 1):
            model(data).square().mean().backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "rank": rank, "step": step}
            ckpt.snapshot(state, root / f"global_step{step}" / f"rank{rank}.pt")
            commits.append(ckpt.commit(f"global_step{step}"))
        ckpt.wait()
        for fut in commits:
            fut.result(timeout=120)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
