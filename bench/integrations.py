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

Two costs per checkpoint, by the same rule for both contenders:

- **blocked**: the time the training thread spends inside the framework's save call and
  inside datastates' fence (``Client.wait`` before the optimizer step): what it waits for;
- **lost**: how much longer the saving iteration and the next one took than a plain
  iteration (the median of the others). This also charges datastates the CPU its daemon
  takes from forward and backward while it copies (on 2 cores, a real cost).

Alongside, a ``torch.save`` of the same state and a raw buffered write of as many bytes,
each fsynced, measured in the same run. Absolute times drift on this machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
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
    """Each training iteration's duration, checkpoint included, to charge every checkpoint what it cost."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.saved: set[int] = set()
        """The iterations that ended with a save."""
        self._last = 0.0

    def tick(self) -> None:
        """An iteration begins (the previous one, if any, ends)."""
        now = time.perf_counter()
        if self._last:
            self.steps.append(now - self._last)
        self._last = now

    def blocking(self) -> list[float]:
        """Per checkpoint: how much longer than a plain iteration the one that saved and the one after it took."""
        near = self.saved | {i + 1 for i in self.saved}
        plain = median([t for i, t in enumerate(self.steps) if i not in near] or [0.0])
        return [max(0.0, self.steps[i] - plain) + max(0.0, self.steps[i + 1] - plain)
                for i in sorted(self.saved) if i + 1 < len(self.steps)]


class Stops:
    """Time the training thread spends inside checkpoint calls: the framework's save, and datastates' fence.

    Only the outermost of nested calls counts (a save that fences inside is counted once).
    """

    def __init__(self) -> None:
        self.total = 0.0
        self._depth = 0

    @contextmanager
    def timing(self, calls: list[tuple[Any, str]]) -> Iterator[None]:
        """Time every call of ``owner.name`` for each pair, while inside."""
        originals = [(owner, name, owner.__dict__[name]) for owner, name in calls]
        for owner, name, fn in originals:
            setattr(owner, name, self._timed(fn))
        try:
            yield
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.total += time.perf_counter() - t0
        return call


def save_calls(name: str) -> list[tuple[Any, str]]:
    """The methods a framework saves a checkpoint in, and datastates' fence (``Client.wait``)."""
    from datastates.client.client import Client

    if name == "deepspeed":
        from deepspeed.runtime.engine import DeepSpeedEngine
        calls = [(DeepSpeedEngine, "save_checkpoint")]
    elif name == "lightning":
        import pytorch_lightning as pl
        calls = [(pl.Trainer, "save_checkpoint")]
    else:
        from transformers import Trainer

        from datastates.integrations.transformers import DatastatesTrainer
        calls = [(Trainer, "_save_checkpoint"), (DatastatesTrainer, "_save_checkpoint")]
    return [*calls, (Client, "wait")]


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


# -- DeepSpeed ---------------------------------------------------------------------------


@contextmanager
def deepspeed_group() -> Iterator[Any]:
    """A gloo process group of one, as the ``deepspeed`` launcher sets up for a single rank."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1"}
    os.environ.update(env)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # a C++ build at init, useless for one rank
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        yield deepspeed
    finally:
        torch.distributed.destroy_process_group()
        for name in env:  # or the next framework takes this process for a rank of a distributed job
            os.environ.pop(name)


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
        clock.tick()
        engine.backward(engine(torch.randn(args.batch, width)).square().mean())
        engine.step()
        if (i + 1) % args.every == 0:
            engine.save_checkpoint(folder)
            clock.saved.add(i)
    clock.tick()
    nbytes = folder_bytes(folder)
    engine.destroy()  # datastates: commits the last tag and waits until it is durable
    return clock.blocking(), nbytes


# -- Lightning ---------------------------------------------------------------------------


def run_lightning(mode: str, folder: str, args: argparse.Namespace) -> tuple[list[float], int]:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from datastates.integrations.lightning import DatastatesCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(args.params, args.layers)

        def training_step(self, batch: torch.Tensor, _idx: int) -> torch.Tensor:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    clock = StepClock()

    class Clock(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            clock.tick()

        def on_train_end(self, *_: Any) -> None:
            clock.tick()

    module = Module()
    data = torch.utils.data.DataLoader(torch.randn(args.steps * args.batch, module.net[0].in_features),
                                       batch_size=args.batch)
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Clock(), ModelCheckpoint(
                             folder, every_n_train_steps=args.every, save_top_k=-1)],
                         plugins=[DatastatesCheckpointIO()] if mode == "datastates" else None)
    trainer.fit(module, data)  # datastates: teardown waits until every checkpoint is committed
    clock.saved = {i for i in range(args.steps) if (i + 1) % args.every == 0}
    return clock.blocking(), folder_bytes(folder)


# -- Hugging Face ------------------------------------------------------------------------


def run_transformers(mode: str, folder: str, args: argparse.Namespace) -> tuple[list[float], int]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from datastates.integrations.transformers import DatastatesTrainer

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(args.params, args.layers)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.net(x).square().mean()}

    clock = StepClock()

    class Clock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            clock.tick()

        def on_train_end(self, *_: Any, **__: Any) -> None:
            clock.tick()

    model = Model()
    width = model.net[0].in_features
    data = [{"x": torch.randn(width)} for _ in range(args.steps * args.batch)]
    targs = TrainingArguments(output_dir=folder, max_steps=args.steps, per_device_train_batch_size=args.batch,
                              save_strategy="steps", save_steps=args.every, report_to=[], use_cpu=True,
                              remove_unused_columns=False, disable_tqdm=True, logging_strategy="no",
                              learning_rate=1e-4, dataloader_num_workers=0)
    cls = DatastatesTrainer if mode == "datastates" else Trainer
    cls(model=model, args=targs, train_dataset=data, callbacks=[Clock()]).train()
    clock.saved = {i for i in range(args.steps) if (i + 1) % args.every == 0}
    return clock.blocking(), folder_bytes(folder)


# -- the bench ---------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[str, str, argparse.Namespace], tuple[list[float], int]]] = {
    "deepspeed": run_deepspeed,
    "lightning": run_lightning,
    "transformers": run_transformers,
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
    ap.add_argument("--steps", type=int, default=24, help="training steps per run (default 24)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5)")
    ap.add_argument("--params", type=float, default=32, help="model size in millions of fp32 parameters (default 32)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64, help="rows per step (default 64: steps long enough to copy "
                    "during, as a real model's are)")
    ap.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh folder under /tmp)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    frameworks = [f for f in args.frameworks.split(",") if f]
    root = os.path.realpath(args.root or tempfile.mkdtemp(prefix="ds-integrations-", dir="/tmp"))
    blocked: dict[tuple[str, str], list[float]] = {}
    """Seconds inside the save call and the fence, per checkpoint, one value per run."""
    lost: dict[tuple[str, str], list[float]] = {}
    """Seconds the training loop lost per checkpoint (StepClock), one value per checkpoint."""
    sizes: dict[str, int] = {}
    baseline: dict[str, list[float]] = {"torch.save": [], "raw write": []}
    with datastatesd(root, log_level="error") as endpoint:
        os.environ[ENDPOINT_ENV] = endpoint
        for name in frameworks:  # DeepSpeed's process group must be gone before the next framework starts
            with deepspeed_group() if name == "deepspeed" else nullcontext():
                for run in range(args.runs):
                    for mode in ("default", "datastates"):
                        folder = tempfile.mkdtemp(prefix=f"{name}-{mode}-r{run}-", dir=root)
                        stops = Stops()
                        with stops.timing(save_calls(name)):
                            times, nbytes = RUNNERS[name](mode, folder, args)
                        checkpoints = args.steps // args.every
                        if mode == "default":  # datastates' files may not all be in place when it returns
                            sizes[name] = nbytes // checkpoints
                        lost.setdefault((name, mode), []).extend(times)
                        blocked.setdefault((name, mode), []).append(stops.total / checkpoints)
                        shutil.rmtree(folder)
                        print(f"run {run} {name:<12} {mode:<10} blocked {stops.total / checkpoints:.4f} s per checkpoint; "
                              "lost per checkpoint (s): " + " ".join(f"{t:.3f}" for t in times), flush=True)
        for _ in range(args.runs):
            t_save, t_raw = torch_save_and_raw(root, args.params, args.layers)
            baseline["torch.save"].append(t_save)
            baseline["raw write"].append(t_raw)
    shutil.rmtree(root, ignore_errors=True)

    save, raw = median(baseline["torch.save"]), median(baseline["raw write"])
    print(f"\nmedians over {args.runs} runs; {args.params:g} M parameters; torch.save of model + Adam {save:.3f} s, "
          f"raw write of as many bytes {raw:.3f} s")
    for title, table in (("blocked: inside the save call and the fence", blocked),
                         ("lost: the saving iteration and the next one, beyond a plain iteration", lost)):
        print(f"\n{title} (s per checkpoint)")
        print(f"{'framework':<13} {'checkpoint':>10} {'default':>9} {'datastates':>11} {'ratio':>7} "
              f"{'vs torch.save':>14} {'vs raw write':>13}")
        for name in frameworks:
            d, o = median(table[(name, "default")]), median(table[(name, "datastates")])
            print(f"{name:<13} {sizes[name] / 1e9:>8.2f}GB {d:>9.3f} {o:>11.4f} {o / d:>7.3f} {o / save:>14.3f} "
                  f"{o / raw:>13.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
