"""`make run`: train a tiny GPT a few steps, checkpointing through datastatesd, then restore.

It starts a daemon on the built-in defaults (unless one already serves the default
endpoint), snapshots model + optimizer + RNG state every few steps, fences with wait()
right before each optimizer step, commits each tag, and finally restores the newest
committed tag and checks it is bitwise the state that was snapshotted.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time

import torch
from torch import nn

from datastates.client import Client, daemon_status
from datastates.protocol.endpoint import default_endpoint
from datastates.protocol.paths import default_root
from datastates.protocol.errors import DaemonUnavailable

STEPS, EVERY = 20, 5
ROOT = os.path.join(default_root(), "demo")
"""Under the daemon's built-in root: this user's own folder, made 0700."""


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, layers: int = 2, ctx: int = 64) -> None:
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


def start_daemon() -> subprocess.Popen | None:
    """A datastatesd on the defaults, or None when one already answers there."""
    try:
        daemon_status(timeout=1)
        print(f"using the datastatesd already serving {default_endpoint()}")
        return None
    except DaemonUnavailable:
        pass
    exe = os.path.join(os.path.dirname(sys.executable), "datastatesd")
    proc = subprocess.Popen([exe])
    for _ in range(200):
        try:
            daemon_status(timeout=0.5)
            return proc
        except DaemonUnavailable:
            if proc.poll() is not None:
                sys.exit(f"datastatesd exited with {proc.returncode}")
            time.sleep(0.5)  # not listening yet is said at once
    sys.exit("datastatesd did not come up")


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


def main() -> None:
    torch.manual_seed(0)
    shutil.rmtree(ROOT, ignore_errors=True)
    daemon = start_daemon()
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, 512, (STEPS + 1, 8, 65))
    expected: dict[str, dict] = {}
    commits = []
    client = Client()
    print(f"training {sum(p.numel() for p in model.parameters()):,} parameters for {STEPS} steps, checkpoint every {EVERY}")
    try:
        for step in range(1, STEPS + 1):
            x, y = data[step, :, :-1], data[step, :, 1:]
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            t0 = time.perf_counter()
            client.wait()  # the fence: the daemon must hold its copy before the step changes the tensors
            fence = time.perf_counter() - t0
            opt.step()
            opt.zero_grad()
            if step % EVERY == 0:
                tag = f"global_step{step}"
                state = state_of(model, opt, step)
                expected[tag] = copy.deepcopy(state)
                t0 = time.perf_counter()
                client.snapshot(state, os.path.join(ROOT, tag, "model_states.pt"), tag=tag)
                blocked = time.perf_counter() - t0
                commits.append((tag, client.commit(tag)))
                print(f"step {step:3d}  loss {loss.item():.4f}  snapshot() held the trainer {blocked * 1e3:.1f} ms, last fence {fence * 1e3:.1f} ms")
        for tag, fut in commits:
            print(f"committed {tag}: {fut.result(timeout=120).marker}")
        print()
        print(subprocess.run([os.path.join(os.path.dirname(sys.executable), "datastatesctl"), "status"],
                             capture_output=True, text=True).stdout)
    finally:
        client.close()

    with Client() as again:  # as a restarted trainer would: from the daemon's memory if it holds the tag
        result = again.restore(ROOT, "model_states.pt", map_location="cpu")
    assert result is not None, "nothing committed"
    tag, restored = result.tag, result.state
    fresh = TinyGPT()
    fresh.load_state_dict(restored["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=3e-4)
    fresh_opt.load_state_dict(restored["optimizer"])
    ok = same(expected[tag], restored)
    print(f"latest committed tag: {tag}; restored step {restored['step']} from {result.source}; "
          f"bitwise equal to what was snapshotted: {ok}")
    if daemon is not None:
        daemon.terminate()
        daemon.wait(60)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
