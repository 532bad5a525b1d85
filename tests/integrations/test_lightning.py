"""DatastatesCheckpointIO in a real Lightning Trainer on the CPU: saves, resumes, rotation and the fence."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning is not installed (pip install pytorch-lightning)")

from pytorch_lightning.callbacks import Callback, ModelCheckpoint  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.lightning import DatastatesCheckpointIO, tag_of  # noqa: E402
from datastates.integrations.loading import is_datastates_file  # noqa: E402
from datastates.protocol.errors import CommitError  # noqa: E402
from datastates.protocol.format import MARKER_PREFIX, check_tag, marker_name  # noqa: E402
from datastates.protocol.tags import read_marker  # noqa: E402

from conftest import DaemonProc, addresses, assert_state_equal, read_only, watch_loads  # noqa: E402


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder


class Tiny(pl.LightningModule):
    """A linear layer trained with AdamW on fixed random data: every step changes weights and optimizer state."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()  # so the checkpoint holds Python objects beside the tensors
        self.net = torch.nn.Linear(width, width)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randn(64, self.hparams.width, generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


class Recorder(Callback):
    """Copies of what each save hands over, taken at save time, by global step: what its file must hold."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, Any]] = {}
        self.started: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: pl.Trainer, module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self.saved[trainer.global_step] = clone(
            {"state_dict": checkpoint["state_dict"], "optimizer_states": checkpoint["optimizer_states"]})

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """After a resume has restored everything, before the first step."""
        self.started = clone({"state_dict": module.state_dict(), "optimizer_states": [trainer.optimizers[0].state_dict()],
                              "global_step": trainer.global_step})


def clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, clone(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(clone(v) for v in state)
    return state


def fit(daemon: DaemonProc, model: Tiny, steps: int, *callbacks: Callback, ckpt_path: str | None = None,
        io: DatastatesCheckpointIO | None = None) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=daemon.root, callbacks=list(callbacks),
        plugins=[io or DatastatesCheckpointIO(daemon.endpoint, timeout=60)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def checkpoints(folder: Path) -> dict[str, str]:
    """The folder's entries, each a Lightning file's tag or what it is."""
    return {p.name: ("marker" if p.name.startswith(MARKER_PREFIX) else "file") for p in folder.iterdir()}


def test_a_fit_saves_every_file_through_the_daemon(daemon: DaemonProc) -> None:
    folder = daemon.root / "ckpts"
    fit(daemon, Tiny(), 6, ModelCheckpoint(folder, every_n_train_steps=2, save_top_k=-1, save_last=True))

    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert checkpoints(folder) == {**{n: "file" for n in names}, **{marker_name(n): "marker" for n in names}}
    for name in names:  # each file its own committed tag, written by the daemon in its format
        assert is_datastates_file(folder / name)
        marker = read_marker(str(folder / marker_name(tag_of(str(folder / name)))))
        assert marker is not None and [f.path for f in marker.files] == [name]
    verify = daemon.ctl("verify", str(folder))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert sorted(line.split()[1].rstrip(":") for line in verify.stdout.splitlines()) == sorted(
        str(folder / n) for n in names)
    status = json.loads(daemon.ctl("status", "--json").stdout)
    snapshots = [s for s in status["snapshots"] if s["path"].startswith(str(folder))]
    assert {s["path"] for s in snapshots} == {str(folder / n) for n in names}
    assert len([s for s in snapshots if s["path"] == str(folder / "last.ckpt")]) == 3  # saved again at 2, 4 and 6
    assert datastates.latest(folder) == "last.ckpt"  # committed last

    # no lock-in: Lightning's own loader (plain torch.load, safe mode) reads the daemon's file
    restored = Tiny.load_from_checkpoint(folder / "last.ckpt", weights_only=True)
    assert_state_equal(datastates.load(folder / "epoch=0-step=6.ckpt")["state_dict"], restored.state_dict())


def test_resume_from_last_is_bitwise(daemon: DaemonProc) -> None:
    folder = daemon.root / "ckpts"
    first = Recorder()
    fit(daemon, Tiny(), 4, ModelCheckpoint(folder, every_n_train_steps=2, save_last=True), first)

    again, model = Recorder(), Tiny()
    where, loads = addresses(model), watch_loads(model)
    trainer = fit(daemon, model, 6, ModelCheckpoint(folder, every_n_train_steps=2, save_last=True), again,
                  ckpt_path="last", io=DatastatesCheckpointIO(daemon.endpoint, timeout=60, module=model))
    saved = first.saved[4]  # last.ckpt, saved again at step 4
    assert again.started is not None and again.started["global_step"] == 4
    assert_state_equal(saved["state_dict"], again.started["state_dict"], "weights")
    assert_state_equal(saved["optimizer_states"], again.started["optimizer_states"], "optimizer")
    assert trainer.global_step == 6
    # read into the module's own tensors: Lightning's load_state_dict was handed them, holding the file's values
    assert loads == [(len(where), len(where))] and addresses(model) == where, loads
    assert datastates.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6


def test_top_k_rotation_leaves_only_the_kept_files_committed(daemon: DaemonProc) -> None:
    folder = daemon.root / "ckpts"
    fit(daemon, Tiny(), 5, ModelCheckpoint(folder, every_n_train_steps=1, save_top_k=1, save_last=True))

    kept = ["epoch=0-step=5.ckpt", "last.ckpt"]
    assert checkpoints(folder) == {**{n: "file" for n in kept}, **{marker_name(n): "marker" for n in kept}}
    for name in kept:
        assert read_marker(str(folder / marker_name(name))) is not None, f"{name} is not committed"
    verify = daemon.ctl("verify", str(folder))
    assert verify.returncode == 0 and verify.stdout.count("ok ") == 2, verify.stdout + verify.stderr
    assert not list(daemon.root.rglob("*.dstmp")) and not list(daemon.root.glob(".*"))  # no temp or staged version


def test_a_torch_save_file_of_an_earlier_run_loads_and_is_removed(daemon: DaemonProc) -> None:
    module = Tiny(width=2)
    io = DatastatesCheckpointIO(daemon.endpoint, timeout=60, module=module)
    state = {"state_dict": {k: torch.full_like(v, 7.0) for k, v in module.state_dict().items()}, "epoch": 1,
             "hyper_parameters": {"width": 2}}
    path = daemon.root / "old.ckpt"
    torch.save(state, path)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert_state_equal(state, io.load_checkpoint(path))
    assert_state_equal(before, dict(module.state_dict()))  # torch.load's fresh tensors: Lightning copies them in
    io.remove_checkpoint(path)
    assert not path.exists()
    io.teardown()


def test_with_a_module_only_a_state_dict_that_fits_it_is_read_into_it(daemon: DaemonProc,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A file whose ``state_dict`` fits the module goes into its own tensors, the checkpoint handed back holding
    them; a file without ``state_dict``, or with one the module does not fit (a key short: ``strict_loading=False``
    is Lightning's to judge), is read fresh, and the module is left as it was."""
    module = Tiny(width=4)
    io = DatastatesCheckpointIO(daemon.endpoint, timeout=60, module=module)
    fits = {"state_dict": OrderedDict((k, torch.randn_like(v)) for k, v in module.state_dict().items()), "epoch": 2}
    short = {"state_dict": {"net.weight": torch.randn(4, 4)}, "epoch": 1}
    files = {"fits.ckpt": fits, "short.ckpt": short, "weights-less.ckpt": {"epoch": 3, "w": torch.ones(3)}}
    for name, state in files.items():
        io.save_checkpoint(state, daemon.root / name)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with caplog.at_level("WARNING"):
        assert_state_equal(short, io.load_checkpoint(daemon.root / "short.ckpt"))
        assert_state_equal(files["weights-less.ckpt"], io.load_checkpoint(daemon.root / "weights-less.ckpt"))
    assert_state_equal(before, dict(module.state_dict()))
    assert [r.getMessage().count("['state_dict']['net.bias']") for r in caplog.records] == [1], caplog.text

    where = addresses(module)
    loaded = io.load_checkpoint(daemon.root / "fits.ckpt")
    assert_state_equal(fits, loaded)
    assert {k: v.data_ptr() for k, v in loaded["state_dict"].items()} == where == addresses(module)
    assert_state_equal(fits["state_dict"], module.state_dict())
    io.teardown()


def test_the_fence_keeps_each_checkpoint_at_its_step(start_daemon: Any) -> None:
    """Training goes on right after each save, while the slow daemon still copies: each file holds its own step."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1, direct_io=False)
    folder = d.root / "ckpts"
    recorder = Recorder()
    io = DatastatesCheckpointIO(d.endpoint, timeout=60)
    fit(d, Tiny(width=768), 4, ModelCheckpoint(folder, every_n_train_steps=1, save_top_k=-1), recorder, io=io)

    assert sorted(recorder.saved) == [1, 2, 3, 4]
    for step, saved in recorder.saved.items():
        held = io.load_checkpoint(folder / f"epoch=0-step={step}.ckpt")
        assert_state_equal(saved["state_dict"], held["state_dict"], f"step {step} weights")
        assert_state_equal(saved["optimizer_states"], held["optimizer_states"], f"step {step} optimizer")


@pytest.mark.own_daemon
def test_a_failed_commit_is_raised_at_teardown(daemon: DaemonProc) -> None:
    folder = daemon.root / "ckpts"
    folder.mkdir()
    io = DatastatesCheckpointIO(daemon.endpoint, timeout=60)
    with read_only(folder):
        io.save_checkpoint({"state_dict": {"w": torch.ones(4)}}, folder / "last.ckpt")  # returns at once
        with pytest.raises(CommitError, match="last.ckpt"):
            io.teardown()
    assert not (folder / "last.ckpt").exists() and not (folder / marker_name("last.ckpt")).exists()


def test_each_file_name_gives_its_own_tag() -> None:
    assert tag_of("/ckpt/run/epoch=0-step=10.ckpt") == "epoch=0-step=10.ckpt"
    odd = [tag_of(f"/ckpt/run/{name}") for name in ("val loss{0.5}.ckpt", "val_loss_0.5_.ckpt", "x" * 300, ".hidden", "...")]
    assert len(set(odd)) == len(odd) and all(check_tag(t) == t for t in odd)
    # a folder above named like the file would take its marker, as a tag's own folder: the tag is hashed instead
    assert tag_of("/ckpt/last.ckpt/last.ckpt") != "last.ckpt"


def test_other_optimizers_step_as_before_while_the_plugin_fences(daemon: DaemonProc) -> None:
    """The fence is a global step pre-hook: an optimizer stepped outside Lightning (no closure, or a positional
    one) still steps, its closure runs once, and the fence waits for a snapshot first."""
    io = DatastatesCheckpointIO(endpoint=daemon.endpoint)
    try:
        model = torch.nn.Linear(256, 256)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.weight.detach().clone()
        io.save_checkpoint({"w": model.weight.detach()}, daemon.root / "plain.ckpt")
        model(torch.ones(1, 256)).sum().backward()
        opt.step()  # no closure: waits for the daemon's copy, then updates
        calls = []

        def closure() -> torch.Tensor:
            calls.append(1)
            opt.zero_grad()
            loss = model(torch.ones(1, 256)).sum()
            loss.backward()
            return loss

        assert isinstance(opt.step(closure), torch.Tensor) and calls == [1]  # positional closure
        io.teardown()
        assert_state_equal({"w": before}, datastates.load(daemon.root / "plain.ckpt"))
    finally:
        io.teardown()
