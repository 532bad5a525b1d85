"""Lightning's restore of a model of a few hundred MB, in place: against ``datastates.load(path, into=...)`` alone.

Why: an integration whose framework calls ``load_state_dict`` itself reads the
file into the module's own tensors and hands the framework those very tensors, so the
framework's copy is of each tensor onto itself, which torch skips. Its restore should then
cost what the in-place load alone costs, not that plus a second copy of the model.

One checkpoint of an MLP (``--params`` million fp32 parameters) is written through
``DatastatesCheckpointIO``; then, per run, with the file evicted from the page cache first,
contenders interleaved:

- ``into alone``: ``datastates.load(path, into={"state_dict": module.state_dict()}, strict=False)``;
- ``lightning in place``: ``Trainer.validate(model, ckpt_path=path)`` with ``DatastatesCheckpointIO(module=model)``,
  timed from the callbacks' ``setup`` (just before Lightning loads the file) to the end of the module's
  ``load_state_dict`` (a post-hook): Lightning's whole model restore;
- ``lightning fresh``: the same without ``module``: the file read into fresh memory, then copied in.

Beside them, ``copy alone``: ``load_state_dict`` of a fresh copy of the weights already in
memory, what the fresh restore pays on top of its read and the in-place one avoids.
Prints medians over ``--runs`` and the ratios to ``into alone``. The machine is shared:
absolute times drift, the ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, drop_caches, median, print_medians, timed  # noqa: E402
from integrations import mlp  # noqa: E402

import pytorch_lightning as pl  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.lightning import DatastatesCheckpointIO  # noqa: E402


class Net(pl.LightningModule):
    def __init__(self, params_m: float, layers: int, seed: int) -> None:
        super().__init__()
        self.net = mlp(params_m, layers, seed)

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        pass

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(1, 1)), batch_size=1)


class Clock(pl.Callback):
    """Starts at the callbacks' ``setup``, just before Lightning loads the checkpoint; ``stop`` is the module's
    ``load_state_dict`` post-hook, the end of Lightning's model restore."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.start = self.stop = 0.0
        module.register_load_state_dict_post_hook(lambda *_: setattr(self, "stop", time.perf_counter()))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.start = time.perf_counter()


def lightning_restore(endpoint: str, model: Net, path: str, in_place: bool) -> float:
    clock = Clock(model)
    io = DatastatesCheckpointIO(endpoint, module=model if in_place else None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, plugins=[io], callbacks=[clock])
    trainer.validate(model, ckpt_path=path, verbose=False)
    return clock.stop - clock.start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=75, help="model size in millions of fp32 parameters (default 75)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--root", default=None, help="folder for the checkpoint (default: a fresh folder under /var/tmp)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.WARNING)  # its "Restoring states ..." lines, each run
    root = os.path.realpath(args.root or tempfile.mkdtemp(prefix="ds-integration-restore-", dir="/var/tmp"))
    path = os.path.join(root, "last.ckpt")
    try:
        with datastatesd(root, log_level="error") as endpoint:
            model = Net(args.params, args.layers, seed=0)
            nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
            trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                                 enable_model_summary=False, enable_checkpointing=False,
                                 plugins=[DatastatesCheckpointIO(endpoint)])
            trainer.validate(model, verbose=False)
            trainer.save_checkpoint(path, weights_only=True)  # Lightning's own checkpoint, of the model alone
            trainer.strategy.checkpoint_io.teardown()  # committed
            model = Net(args.params, args.layers, seed=1)  # another model, restored each run
            want = datastates.load(path)["state_dict"]
            times: dict[str, list[float]] = {"into alone": [], "lightning in place": [], "lightning fresh": [],
                                             "copy alone": []}
            for run in range(args.runs):
                for name in times:
                    drop_caches(root)
                    if name == "into alone":
                        took, _ = timed(datastates.load, path, into={"state_dict": model.state_dict()}, strict=False)
                    elif name == "copy alone":
                        took, _ = timed(model.load_state_dict, {k: v.clone() for k, v in want.items()})
                    else:
                        took = lightning_restore(endpoint, model, path, in_place=name == "lightning in place")
                    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items()), name
                    times[name].append(took)
                    with torch.no_grad():  # the next contender restores something again
                        for p in model.parameters():
                            p.zero_()
                print(f"run {run}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()), flush=True)
            med = print_medians(times, nbytes)
            for name in ("lightning in place", "lightning fresh", "copy alone"):
                print(f"{name} / into alone: {med[name] / med['into alone']:.3f} (every run: "
                      + ", ".join(f"{a / b:.2f}" for a, b in zip(times[name], times["into alone"])) + ")")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
