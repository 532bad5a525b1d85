"""A small, bitwise-deterministic training job that checkpoints through CheckpointManager.

test_resume.py runs it whole, and killed with ``kill -9`` then restarted; test_manager.py
imports its pieces. Every source of change a resume must carry over is in it: AdamW
moments, a StepLR schedule, dropout (the torch generator), input jitter drawn from
``random`` and numpy, and a data order shuffled per epoch from a generator of its own.

usage: resume_job.py ENDPOINT ROOT OUT [--steps N] [--every K] [--keep-last N] [--lockstep]

Prints ``fresh start`` or ``resumed from step S``, then ``step S`` after each step. With
``--lockstep`` it reads a line from stdin after each ``step`` line before it goes on, so a
test can kill it at the step it chose. At the end it writes the model and optimizer
state with ``torch.save`` to OUT.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from datastates.client import Client
from datastates.integrations.manager import CheckpointManager

SAMPLES, FEATURES, TARGETS, BATCH = 256, 16, 4, 16


class ShuffledBatches:
    """Batches of sample indices, in an order drawn per epoch; resumable in the middle of an epoch.

    Its state is the generator's state before the epoch's order was drawn, and the
    position in it: load_state_dict draws the same order again from there.
    """

    def __init__(self, samples: int, batch: int, seed: int) -> None:
        self.samples, self.batch = samples, batch
        self.generator = torch.Generator().manual_seed(seed)
        self._new_epoch()

    def _new_epoch(self) -> None:
        self.epoch_start = self.generator.get_state()
        self.order = torch.randperm(self.samples, generator=self.generator)
        self.pos = 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > self.samples:
            self._new_epoch()
        idx = self.order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_start": self.epoch_start, "pos": self.pos}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["epoch_start"])
        self._new_epoch()
        self.pos = state["pos"]


@dataclass
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: ShuffledBatches
    x: torch.Tensor
    y: torch.Tensor

    def step(self) -> None:
        idx = self.batches.next()
        jitter = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = nn.functional.mse_loss(self.model(self.x[idx] * jitter), self.y[idx])
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()

    def manager(self, client: Client, root: str, **kwargs: Any) -> CheckpointManager:
        return CheckpointManager(client, root, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                 data_loader=self.batches, **kwargs)


def build(seed: int = 0) -> Job:
    """The job's objects; the data set is the same whatever ``seed``, the model's start and the RNGs are not."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.sin(x @ torch.randn(FEATURES, TARGETS, generator=g))
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, TARGETS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return Job(model, optimizer, scheduler, ShuffledBatches(SAMPLES, BATCH, seed + 7), x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("root")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--lockstep", action="store_true")
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)  # process-wide, so here and not in build(), which tests import
    torch.set_num_threads(1)
    job = build()
    with Client(args.endpoint, timeout=60) as client:
        manager = job.manager(client, args.root, keep_last=args.keep_last, every=args.every)
        start = manager.restore()
        print(f"resumed from step {start}" if start is not None else "fresh start", flush=True)
        for step in range((start or 0) + 1, args.steps + 1):
            job.step()
            manager.maybe_save(step)
            print(f"step {step}", flush=True)
            if args.lockstep:
                sys.stdin.readline()
        manager.close()
    torch.save({"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict()}, args.out)


if __name__ == "__main__":
    main()
