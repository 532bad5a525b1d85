"""DatastatesTrainer against the real transformers Trainer on the CPU: a tiny GPT-2 built from a config, no downloads."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded: the model is built from a config
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

import datastates  # noqa: E402
from datastates.client import Client  # noqa: E402
from datastates.client.reader.stream import verify  # noqa: E402
from datastates.integrations.transformers import DatastatesTrainer, last_checkpoint  # noqa: E402
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, UnsupportedFormatError  # noqa: E402
from datastates.protocol.format import INDEX_AT, CommitMarker, marker_name  # noqa: E402

from conftest import DaemonProc, addresses, assert_state_equal, file_index, watch_loads  # noqa: E402

DAEMON_FILES = ["optimizer.pt", "pytorch_model.bin", "rng_state.pth", "scheduler.pt", "training_args.bin"]
"""What the daemon writes into each checkpoint folder; the trainer writes only JSON beside them."""


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test."""
    return shared_daemon_folder


class Tokens(torch.utils.data.Dataset):
    """A tiny fixed language-modelling set, the same in every run."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):
    """What the trainer held at each save, copied as ``on_save`` sees it; and what it held when training began."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.stop_at = stop_at
        self.saved: dict[int, dict[str, Any]] = {}
        self.began: dict[str, Any] = {}

    @staticmethod
    def _state(state: Any, model: Any, optimizer: Any, lr_scheduler: Any) -> dict[str, Any]:
        return copy.deepcopy({"step": state.global_step, "model": model.state_dict(),
                              "optimizer": optimizer.state_dict(), "scheduler": lr_scheduler.state_dict()})

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.began = self._state(state, kw["model"], kw["optimizer"], kw["lr_scheduler"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.stop_at:  # as if the job were killed right after this step's save
            control.should_training_stop = True

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.saved[state.global_step] = self._state(state, kw["model"], kw["optimizer"], kw["lr_scheduler"])


class WatchedClient(Client):
    """A real client that notes each snapshot it sends and each return of wait(): the daemon holds its copies."""

    def __init__(self, *args: Any, events: list[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events = events

    def snapshot(self, *args: Any, **kwargs: Any) -> Any:
        self.events.append("snapshot")
        return super().snapshot(*args, **kwargs)

    def wait(self, timeout: float | None = None) -> None:
        super().wait(timeout)
        self.events.append("copied")


def trainer(daemon: DaemonProc, out: Path, *, seed: int = 0, recorder: Recorder | None = None,
            client: Client | None = None, eval_dataset: Any = None, **args: Any) -> DatastatesTrainer:
    """A DatastatesTrainer of a 1-layer GPT-2 (model seed ``seed``) on ``Tokens``, saving every 2 steps into ``out``."""
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    settings = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=6, save_strategy="steps",
                    save_steps=2, logging_steps=1, learning_rate=1e-2, report_to=[], use_cpu=True, seed=0,
                    disable_tqdm=True, dataloader_num_workers=0)
    settings.update(args)
    return DatastatesTrainer(model=GPT2LMHeadModel(config), args=TrainingArguments(**settings), train_dataset=Tokens(),
                             eval_dataset=eval_dataset,
                             callbacks=[recorder] if recorder else None,
                             client=client, client_options={"endpoint": daemon.endpoint, "timeout": 60})


def committed(out: Path) -> list[str]:
    return sorted((p.name for p in out.glob("checkpoint-*") if (p / marker_name(p.name)).exists()),
                  key=lambda name: int(name.split("-")[1]))


def test_training_saves_each_checkpoint_through_the_daemon(daemon: DaemonProc) -> None:
    """Every checkpoint folder is a committed tag whose files the daemon wrote, holding the state of its step.

    The state is the one on_save saw, although the optimizer steps that follow each save
    change the weights in place: no step runs before the daemon holds its copy.
    """
    out = daemon.root / "run"
    rec = Recorder()
    events: list[str] = []
    steps = register_optimizer_step_pre_hook(lambda *_: events.append("step"))
    with WatchedClient(daemon.endpoint, timeout=60, events=events) as client:
        try:
            trainer(daemon, out, recorder=rec, max_steps=4, client=client).train()
        finally:
            steps.remove()
    since = ""  # what the client did last before each optimizer step
    for e in events:
        if e == "step":
            assert since != "snapshot", f"an optimizer step before the daemon held its copy: {events}"
        else:
            since = e
    assert events.count("step") == 4 and events.count("snapshot") == 2 * len(DAEMON_FILES)

    assert committed(out) == ["checkpoint-2", "checkpoint-4"]
    assert datastates.latest(out) == "checkpoint-4"
    for step in (2, 4):
        folder = out / f"checkpoint-{step}"
        marker = CommitMarker.read(str(folder / marker_name(folder.name)))
        assert sorted(f.path for f in marker.files) == DAEMON_FILES
        for name in DAEMON_FILES:
            verify(folder / name)  # a datastates file, whole: anything else raises
        verified = daemon.ctl("verify", str(folder))
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step
        assert (folder / "config.json").exists()
        expected = rec.saved[step]
        assert_state_equal(expected["model"], datastates.load(folder / "pytorch_model.bin"))
        assert_state_equal(expected["optimizer"], datastates.load(folder / "optimizer.pt"))
        assert_state_equal(expected["scheduler"], datastates.load(folder / "scheduler.pt"))
    reloaded = GPT2LMHeadModel.from_pretrained(out / "checkpoint-4")  # the folder is a model folder too
    assert_state_equal(rec.saved[4]["model"], reloaded.state_dict())
    assert rec.saved[2]["model"]["lm_head.weight"].ne(rec.saved[4]["model"]["lm_head.weight"]).any()


def test_resume_takes_the_newest_committed_checkpoint_bitwise(daemon: DaemonProc) -> None:
    """A run killed after its step-4 save, and a folder of step 6 a crash left uncommitted: resume loads step 4.

    Weights, optimizer, scheduler and global step are those saved, to the bit, and the
    resumed run ends exactly where a run that was never interrupted ends. The weights were
    read into the model's own tensors: ``Trainer``'s ``load_state_dict`` is handed them. A
    folder ``Trainer`` wrote itself (``torch.save`` files) still resumes, by its own code.
    """
    out = daemon.root / "run"
    first = Recorder(stop_at=4)
    trainer(daemon, out, recorder=first).train()
    assert committed(out) == ["checkpoint-2", "checkpoint-4"]
    crashed = out / "checkpoint-6"  # what a kill during the step-6 save leaves: the trainer's files, no marker
    shutil.copytree(out / "checkpoint-4", crashed, ignore=shutil.ignore_patterns("datastates-commit.*"))
    state = json.loads((crashed / "trainer_state.json").read_text())
    (crashed / "trainer_state.json").write_text(json.dumps({**state, "global_step": 6}))
    assert get_last_checkpoint(str(out)) == str(crashed), "Trainer alone would resume from the uncommitted folder"
    assert last_checkpoint(out) == str(out / "checkpoint-4")

    resumed = Recorder()
    job = trainer(daemon, out, seed=1, recorder=resumed)
    where, loads = addresses(job.model), watch_loads(job.model)
    job.train(resume_from_checkpoint=True)
    assert resumed.began["step"] == 4
    for part in ("model", "optimizer", "scheduler"):
        assert_state_equal(first.saved[4][part], resumed.began[part], part)
    assert loads == [(len(where), len(where))] and addresses(job.model) == where, loads

    whole = Recorder()
    trainer(daemon, daemon.root / "whole", recorder=whole).train()
    for part in ("model", "optimizer", "scheduler"):
        assert_state_equal(whole.saved[6][part], resumed.saved[6][part], part)
    assert committed(out) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]  # step 6 saved again, and committed

    plain = daemon.root / "plain" / "checkpoint-4"  # as Trainer itself writes a folder: torch.save files, no marker
    shutil.copytree(out / "checkpoint-4", plain, ignore=shutil.ignore_patterns("datastates-commit.*"))
    for name in ("pytorch_model.bin", "optimizer.pt", "scheduler.pt"):
        torch.save(datastates.load(plain / name), plain / name)
    again = Recorder()
    job = trainer(daemon, plain.parent, seed=1, recorder=again, max_steps=4)
    loads = watch_loads(job.model)
    job.train(resume_from_checkpoint=str(plain))
    for part in ("model", "optimizer", "scheduler"):
        assert_state_equal(first.saved[4][part], again.began[part], part)
    assert loads == [(0, len(where))], loads  # Trainer's torch.load: fresh tensors, copied in


def test_the_best_model_at_the_end_is_read_into_the_models_own_tensors(daemon: DaemonProc) -> None:
    """load_best_model_at_end: the best checkpoint's weights, bitwise, read into the model's own tensors."""
    rec = Recorder()
    job = trainer(daemon, daemon.root / "run", recorder=rec, max_steps=4, eval_strategy="steps", eval_steps=2,
                  load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True,
                  eval_dataset=Tokens())
    where, loads = addresses(job.model), watch_loads(job.model)
    job.train()
    best = int(job.state.best_model_checkpoint.rsplit("-", 1)[1])
    assert best == 2  # the loss falls as it trains: "greater is better" makes the first checkpoint the best
    assert_state_equal(rec.saved[best]["model"], job.model.state_dict())
    assert loads == [(len(where), len(where))] and addresses(job.model) == where, loads


def test_resume_without_a_committed_checkpoint_is_refused(daemon: DaemonProc) -> None:
    out = daemon.root / "run"
    (out / "checkpoint-2").mkdir(parents=True)  # a save that never finished
    assert last_checkpoint(out) is None
    with pytest.raises(ValueError, match="No committed checkpoint"):
        trainer(daemon, out).train(resume_from_checkpoint=True)


def test_save_total_limit_prunes_only_committed_checkpoints(daemon: DaemonProc) -> None:
    """save_total_limit=2 keeps the two newest committed; a folder a crash left is not the trainer's to delete."""
    out = daemon.root / "run"
    (out / "checkpoint-1").mkdir(parents=True)
    trainer(daemon, out, max_steps=8, save_total_limit=2).train()
    assert committed(out) == ["checkpoint-6", "checkpoint-8"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-6", "checkpoint-8"]
    assert datastates.latest(out) == "checkpoint-8"


def test_a_committed_checkpoint_is_never_written_again(daemon: DaemonProc) -> None:
    """Training again from scratch into the same output_dir stops at its first save, and the committed one stands."""
    out = daemon.root / "run"
    trainer(daemon, out, max_steps=2).train()
    folder = out / "checkpoint-2"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(InvalidRequestError, match="committed checkpoint already"):
        trainer(daemon, out, seed=1, max_steps=2).train()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert daemon.ctl("verify", str(folder)).returncode == 0


@pytest.mark.parametrize("where", ["data", "index"])
def test_resume_refuses_a_committed_checkpoint_whose_bytes_changed(daemon: DaemonProc, where: str) -> None:
    """torch.load checks no checksum: resume verifies the files, so a flipped bit is not trained on. A bit of the
    weights' data fails their in-place load; a bit of the name of their index record makes them look like a
    ``torch.save`` file, which Trainer would read with torch.load: verified first, they are no datastates file."""
    out = daemon.root / "run"
    trainer(daemon, out, max_steps=2).train()
    weights = out / "checkpoint-2" / "pytorch_model.bin"
    raw = bytearray(weights.read_bytes())
    at = file_index(bytes(raw))[3] + 100 if where == "data" else INDEX_AT - 1  # the size stays
    raw[at] ^= 0x01
    weights.write_bytes(bytes(raw))
    assert last_checkpoint(out) == str(out / "checkpoint-2")
    with pytest.raises(CorruptCheckpointError if where == "data" else UnsupportedFormatError):
        trainer(daemon, out, max_steps=4).train(resume_from_checkpoint=True)
