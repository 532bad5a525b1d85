"""`make run`: train a tiny GPT a few steps, checkpointing through datastatesd, then restore.

It starts a daemon on the built-in defaults (unless one already serves the default
endpoint), snapshots model + optimizer + RNG state every few steps, fences with wait()
right before each optimizer step, commits each tag, and finally restores the newest
committed tag and checks it is bitwise the state that was snapshotted.

One line per checkpoint shows what the trainer paid and what the daemon did meanwhile:
``snapshot()`` against a ``torch.save`` of the same state (made just before, then removed),
how much of the state the daemon had copied by the fence (that is, during the next
forward and backward), the fence itself (``wait()`` before the optimizer step), and when
the commit said the tag is durable. Logs (the daemon's, warnings) go to one file, named at start.
"""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch
from torch import nn

from datastates.client import Client, SnapshotHandle, daemon_status
from datastates.protocol.endpoint import default_endpoint
from datastates.protocol.paths import default_root
from datastates.protocol.errors import DaemonUnavailable

STEPS, EVERY = 20, 5
ROOT = os.path.join(default_root(), "demo")
"""Under the daemon's built-in root: this user's own folder, made 0700."""
LOG = os.path.join(tempfile.gettempdir(), f"datastates-demo-{os.getuid()}.log")
"""The daemon's output, warnings and the client's log lines: kept out of the demo's own output."""


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 384, layers: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2 does

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1])
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.norm(self.blocks(self.tok(x) + self.pos(pos), mask=mask, is_causal=True)))


def start_daemon(log: int) -> subprocess.Popen | None:
    """A datastatesd on the defaults, writing to ``log``, or None when one already answers there."""
    try:
        daemon_status(timeout=1)
        print(f"using the datastatesd already serving {default_endpoint()}")
        return None
    except DaemonUnavailable:
        pass
    exe = os.path.join(os.path.dirname(sys.executable), "datastatesd")
    proc = subprocess.Popen([exe], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(200):
        try:
            status = daemon_status(timeout=0.5)["daemon"]
            pool = status["host_memory"]
            # as a job script starts it before training: it has cleaned up after killed daemons, and mapped its pool
            if status["leftovers_removed"] is not None and pool["chunks_allocated"] * pool["chunk_size"] >= pool["budget_bytes"]:
                return proc
            time.sleep(0.2)
        except DaemonUnavailable:
            if proc.poll() is not None:
                sys.exit(f"datastatesd exited with {proc.returncode}; see {LOG}")
            time.sleep(0.5)  # not listening yet is said at once
    sys.exit(f"datastatesd did not come up; see {LOG}")


def state_of(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state()}


def same(a: object, b: object) -> bool:
    """Bitwise equality of two state trees."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass
class Checkpoint:
    """What one checkpoint cost the trainer, and what the daemon did meanwhile (times in seconds)."""

    step: int
    handle: SnapshotHandle
    snapshot_s: float
    torch_save_s: float
    taken_at: float
    committed: Future
    copied_by_fence: float = -1.0
    """The share of the state the daemon had copied when the trainer reached the next fence."""
    fence_s: float = -1.0
    durable_at: float = -1.0

    def row(self) -> str:
        copied = f"{self.copied_by_fence:.0%}"
        return (f"{self.step:4d}  {self.snapshot_s * 1e3:8.1f} ms  {self.torch_save_s * 1e3:8.1f} ms  "
                f"{copied:>11} of {self.handle.nbytes / 2**20:.1f} MiB  {self.fence_s * 1e3:6.1f} ms  "
                f"{(self.durable_at - self.taken_at) * 1e3:8.0f} ms")


HEADER = ("step  snapshot()   torch.save   copied by the fence    fence    durable after\n"
          "      (trainer blocked; the same state,   (during fwd+bwd)           (commit resolved,\n"
          "                    not even fsynced)                                fsynced, marker written)")


def copied_share(client: Client, handle: SnapshotHandle) -> float:
    """How much of ``handle``'s snapshot the daemon holds by now, from its status."""
    job_id = handle.id  # once the daemon has admitted it
    job = next(j for j in client.status()["snapshots"] if j["id"] == job_id)
    return job["copied_bytes"] / max(1, job["total_bytes"])


def time_torch_save(state: dict) -> float:
    """What ``torch.save`` of ``state`` blocks a trainer for, to a file on the same file system (then removed)."""
    probe = os.path.join(ROOT, "torch_save_probe.pt")
    t0 = time.perf_counter()
    torch.save(state, probe)
    took = time.perf_counter() - t0
    os.remove(probe)
    return took


def main() -> None:
    torch.manual_seed(0)
    subprocess.run(["rm", "-rf", ROOT], check=True)
    os.makedirs(ROOT, mode=0o700)
    logging.basicConfig(filename=LOG, level=logging.INFO, format="%(asctime)s trainer %(levelname)s %(message)s")
    logging.captureWarnings(True)  # torch's UserWarnings too
    print(f"logs (datastatesd, warnings): {LOG}")
    with open(LOG, "a") as log:
        daemon = start_daemon(log.fileno())
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 512, (STEPS + 1, 8, 65))
    expected: dict[str, dict] = {}
    checkpoints: list[Checkpoint] = []
    client = Client()
    print(f"training {sum(p.numel() for p in model.parameters()):,} parameters for {STEPS} steps, "
          f"checkpoint every {EVERY}, under {ROOT}\n")
    print(HEADER)
    try:
        for step in range(1, STEPS + 1):
            x, y = data[step, :, :-1], data[step, :, 1:]
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            last = checkpoints[-1] if checkpoints else None
            if last is not None and last.fence_s < 0:
                last.copied_by_fence = copied_share(client, last.handle)
            t0 = time.perf_counter()
            client.wait()  # the fence: the daemon must hold its copy before the step changes the tensors
            if last is not None and last.fence_s < 0:
                last.fence_s = time.perf_counter() - t0
            opt.step()
            opt.zero_grad()
            for done in [c for c in checkpoints if c.fence_s >= 0 and c.committed.done() and c.durable_at >= 0]:
                print(done.row())
                checkpoints.remove(done)
            if step % EVERY == 0:
                tag = f"global_step{step}"
                state = state_of(model, opt, step)
                expected[tag] = copy.deepcopy(state)
                torch_save_s = time_torch_save(state)
                t0 = time.perf_counter()
                handle = client.snapshot(state, os.path.join(ROOT, tag, "model_states.pt"), tag=tag)
                cp = Checkpoint(step, handle, time.perf_counter() - t0, torch_save_s, t0, client.commit(tag))
                cp.committed.add_done_callback(lambda _f, cp=cp: setattr(cp, "durable_at", time.perf_counter()))
                checkpoints.append(cp)
        client.wait()
        for cp in checkpoints:  # the last one's fence is the wait() above, with no training to overlap
            cp.committed.result(timeout=120)
            if cp.fence_s < 0:
                cp.copied_by_fence, cp.fence_s = 1.0, 0.0
            while cp.durable_at < 0:  # the callback runs right after result() returns
                time.sleep(0.001)
            print(cp.row())
    finally:
        client.close()
    print("the daemon also keeps each tag's copy in /dev/shm (a replica, for restores after a crash): the first snapshots\n"
          "move into fresh /dev/shm pages once; later ones write over the replica they supersede (daemon/replica/table.py)")

    fresh = TinyGPT()  # as a restarted trainer would: its model built, then the newest committed tag read into it
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-4)
    with Client() as again:  # from the daemon's memory if it holds the tag; straight into the model's own tensors
        result = again.restore(ROOT, "model_states.pt", into={"model": fresh.state_dict()}, strict=False)
    assert result is not None, "nothing committed"
    tag, restored = result.tag, result.state
    fresh_opt.load_state_dict(restored["optimizer"])  # it had not stepped: its state was read fresh (strict=False)
    ok = same(expected[tag], restored) and same(expected[tag]["model"], fresh.state_dict())
    print(f"\nrestored the latest committed tag, {tag} (step {restored['step']}), from the daemon's {result.source}, "
          f"into the new model's own tensors; bitwise equal to what was snapshotted: {ok}")
    if daemon is not None:
        daemon.terminate()
        daemon.wait(60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
