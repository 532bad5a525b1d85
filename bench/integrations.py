"""What a trainer pays per checkpoint in each framework: its default saving against datastates, in one run.

Why: the integrations exist so a job switches with a config line or a plugin; what it
gains is the time its training thread stops for each checkpoint. For each framework this
trains the same small MLP on the CPU, checkpointing every ``--every`` steps, once with
the framework's own saving and once through datastatesd, interleaved run by run:

- ``deepspeed``: ZeRO stage 1, DeepSpeed's default ``TorchCheckpointEngine`` against the
  ``"datastates_ckpt": {}`` config entry;
- ``lightning``: ``ModelCheckpoint`` with ``torch.save`` (Lightning's ``TorchCheckpointIO``)
  against ``DatastatesCheckpointIO``;
- ``transformers``: ``Trainer`` saving every ``--every`` steps against the datastates Trainer.

A checkpoint's blocking time is what the training thread loses to it: the save call,
plus how much longer the next step took than a plain step (the median of the steps
neither saving nor right after a save). That charges datastates its fence before the
optimizer step and the framework its synchronous write, by the same rule. Alongside, a
``torch.save`` of the same state and a raw buffered write of as many bytes, each fsynced,
measured in the same run. Absolute times drift on this machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median, state_bytes, timed  # noqa: E402

from datastates.protocol.endpoint import ENDPOINT_ENV  # noqa: E402

FRAMEWORKS = ("deepspeed", "lightning", "transformers")


def mlp(params_m: float, layers: int, seed: int = 0) -> nn.Sequential:
    """``layers`` square Linear layers holding about ``params_m`` million parameters."""
    torch.manual_seed(seed)
    width = int((params_m * 1e6 / layers) ** 0.5)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


class StepClock:
    """Times each training step and each save, to charge every checkpoint what it cost the training thread."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.saves: dict[int, float] = {}
        """Step index the save followed → the save call's seconds."""

    def blocking(self) -> list[float]:
        after = {i + 1 for i in self.saves}
        plain = median([t for i, t in enumerate(self.steps) if i not in after and i not in self.saves] or [0.0])
        return [s + max(0.0, self.steps[i + 1] - plain) for i, s in self.saves.items() if i + 1 < len(self.steps)]


# -- DeepSpeed ---------------------------------------------------------------------------


@contextmanager
def deepspeed_group() -> Iterator[Any]:
    """A gloo process group of one, as the ``deepspeed`` launcher sets up for a single rank."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a C++ build at init, useless for one rank
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield deepspeed
    finally:
        torch.distributed.destroy_process_group()


def run_deepspeed(mode: str, folder: str, args: argparse.Namespace) -> tuple[list[float], int]:
    import deepspeed

    model = mlp(args.params, args.layers)
    config: dict[str, Any] = {"train_batch_size": args.batch, "zero_optimization": {"stage": 1},
                              "steps_per_print": 1 << 30}
    if mode == "datastates":
        config["datastates_ckpt"] = {}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
                                      config=config)
    width = model[0].in_features
    clock = StepClock()
    for i in range(args.steps):
        x = torch.randn(args.batch, width)
        t0 = time.perf_counter()
        engine.backward(engine(x).square().mean())
        engine.step()
        clock.steps.append(time.perf_counter() - t0)
        if (i + 1) % args.every == 0 and i + 1 < args.steps:
            clock.saves[i], _ = timed(engine.save_checkpoint, folder)
    nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
    engine.destroy()  # datastates: commits the last tag and waits until it is durable
    return clock.blocking(), nbytes


# -- the bench ---------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[str, str, argparse.Namespace], tuple[list[float], int]]] = {
    "deepspeed": run_deepspeed,
}


def torch_save_and_raw(folder: str, params_m: float, layers: int) -> tuple[float, float]:
    """``torch.save`` of model + Adam state of the same size, and a raw buffered write of as many bytes, fsynced."""
    model = mlp(params_m, layers)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, model[0].in_features)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    path = os.path.join(folder, "torch.pt")

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    t_save, _ = timed(save)
    raw = os.urandom(1 << 20) * (state_bytes(state) >> 20)

    def write() -> None:
        with open(path, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())

    t_raw, _ = timed(write)
    os.unlink(path)
    return t_save, t_raw


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated subset of {','.join(FRAMEWORKS)}")
    ap.add_argument("--runs", type=int, default=3, help="repeats of each contender, interleaved; medians reported")
    ap.add_argument("--steps", type=int, default=25, help="training steps per run (default 25)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    ap.add_argument("--params", type=float, default=32, help="model size in millions of fp32 parameters (default 32)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh folder under /tmp)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    frameworks = [f for f in args.frameworks.split(",") if f]
    root = os.path.realpath(args.root or tempfile.mkdtemp(prefix="ds-integrations-", dir="/tmp"))
    blocking: dict[tuple[str, str], list[float]] = {}
    sizes: dict[str, int] = {}
    baseline: dict[str, list[float]] = {"torch.save": [], "raw write": []}
    with datastatesd(root, log_level="error") as endpoint, deepspeed_group() if "deepspeed" in frameworks else nullcontext():
        os.environ[ENDPOINT_ENV] = endpoint
        for run in range(args.runs):
            for name in frameworks:
                for mode in ("default", "datastates"):
                    folder = tempfile.mkdtemp(prefix=f"{name}-{mode}-r{run}-", dir=root)
                    times, nbytes = RUNNERS[name](mode, folder, args)
                    if mode == "default":  # datastates' files may not all be in place when it returns
                        sizes[name] = nbytes
                    blocking.setdefault((name, mode), []).extend(times)
                    shutil.rmtree(folder)
                    print(f"run {run} {name:<12} {mode:<10} blocking per checkpoint (s): "
                          + " ".join(f"{t:.3f}" for t in times), flush=True)
            t_save, t_raw = torch_save_and_raw(root, args.params, args.layers)
            baseline["torch.save"].append(t_save)
            baseline["raw write"].append(t_raw)
    shutil.rmtree(root, ignore_errors=True)

    save, raw = median(baseline["torch.save"]), median(baseline["raw write"])
    print(f"\nmedians over {args.runs} runs; {args.params:g} M parameters; torch.save of model + Adam {save:.3f} s, "
          f"raw write of as many bytes {raw:.3f} s")
    print(f"{'framework':<13} {'checkpoint':>10} {'default (s)':>12} {'datastates (s)':>15} {'ratio':>7} "
          f"{'vs torch.save':>14} {'vs raw write':>13}")
    for name in frameworks:
        d, o = statistics.median(blocking[(name, "default")]), statistics.median(blocking[(name, "datastates")])
        print(f"{name:<13} {sizes[name] / 1e9:>8.2f}GB {d:>12.3f} {o:>15.4f} {o / d:>7.3f} {o / save:>14.3f} "
              f"{o / raw:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
