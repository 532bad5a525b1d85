"""Hugging Face ``Trainer`` checkpoints through datastatesd: ``DatastatesTrainer`` is a drop-in ``Trainer``.

Each ``checkpoint-<step>`` folder is one datastates tag. The daemon writes the files that
hold tensors or pickles, under the names Hugging Face's loaders read (``pytorch_model.bin``,
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``, ``rng_state.pth``, ``training_args.bin``):
they are format-2 files, torch zips that ``torch.load(weights_only=True)`` reads, so
``Trainer``'s own resume code loads them unchanged. The trainer writes only the JSON files
(``trainer_state.json``, ``config.json``, ``generation_config.json``, a tokenizer's files),
fsyncs them, and only then sends the commit, so a committed folder always holds them.

Resuming (``train(resume_from_checkpoint=True)``) takes the newest *committed* checkpoint,
never a folder a crash left half written. ``save_total_limit`` prunes committed checkpoints
marker first (protocol/retention.py), never one still being written nor the newest
committed. A committed folder is never written into again: saving the same step twice
into one ``output_dir`` (training it again from scratch) is refused, since its JSON files
would change under its commit. Not supported: DeepSpeed (use the plain ``Trainer`` with
``"datastates_ckpt": {}`` in the DeepSpeed config),
FSDP, XLA and SageMaker model parallelism, and ``push_to_hub``.

**In place.** Resuming reads a datastates ``pytorch_model.bin`` straight into the model's
own tensors (integrations/loading.py), wherever they are, and ``Trainer``'s
``load_state_dict`` then copies each tensor onto itself, which torch skips. The optimizer
has no state before its first step, so ``optimizer.pt`` is read fresh (by
``datastates.load``, as ``scheduler.pt``) and adopted by ``load_state_dict``. These three
files are checked against their checksums as they are read; the other files of the
folder are verified before ``Trainer`` reads them with ``torch.load``. A folder whose
weights are not ours (a ``torch.save`` file, safetensors, shards or adapters: a job that
switched) is loaded by ``Trainer``'s own code, as are weights that do not fit the model key
for key (``Trainer`` loads them with ``strict=False``; read fresh, nothing written first).
"""

from __future__ import annotations

import logging
import os
import random
import re
from typing import Any, Callable

import numpy as np
import torch

try:
    from transformers import PreTrainedModel, Trainer, TrainerCallback
    from transformers.trainer import (OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME,
                                      TRAINING_ARGS_NAME)
    from transformers.trainer_callback import ExportableState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from transformers.training_args import ParallelMode
    from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME
except ImportError as exc:  # datastates itself never needs transformers; only this module does
    raise ImportError(f"datastates.integrations.transformers needs transformers (pip install transformers): {exc}") from exc

from datastates.client.client import Client
from datastates.client.reader.stream import verify
from datastates.integrations.pending_commits import PendingCommits
from datastates.integrations.loading import is_datastates_file, load_any
from datastates.protocol.errors import InvalidRequestError
from datastates.protocol.fileio import fsync_dir
from datastates.protocol.format import marker_name
from datastates.protocol.retention import prune
from datastates.protocol.tags import committed_tags, read_marker

log = logging.getLogger(__name__)

CHECKPOINT = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-\d+")
"""The tags ``Trainer`` names its checkpoint folders by, and the only ones resume and pruning look at."""


def last_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """``get_last_checkpoint`` for datastates: the newest *committed* ``checkpoint-<step>`` folder under ``output_dir``, or None."""
    tags = committed_tags(os.fspath(output_dir), own_folder=True, accept=CHECKPOINT.fullmatch)
    return tags[0].folder if tags else None


READ_HERE = (WEIGHTS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME)
"""The files ``DatastatesTrainer`` reads itself, by ``datastates.load``, which checks their checksums as it reads."""


def _verify(folder: str) -> None:
    """Check every file a committed checkpoint lists that ``Trainer`` reads with ``torch.load`` (which checks no
    checksum), sizes and checksums, before it does.

    A folder without a commit marker (one ``Trainer`` wrote itself) is left to ``Trainer``.
    """
    marker = read_marker(os.path.join(folder, marker_name(os.path.basename(os.path.normpath(folder)))))
    for rec in marker.files if marker is not None else []:
        path = os.path.join(folder, rec.path)
        if rec.path not in READ_HERE or not is_datastates_file(path):  # one no longer ours goes to torch.load
            verify(path)


def _ours(folder: str, *names: str) -> list[str] | None:
    """The paths of ``names`` in ``folder`` if each is a datastates file, else None (``Trainer``'s own to load)."""
    paths = [os.path.join(folder, name) for name in names]
    return paths if all(os.path.isfile(p) and is_datastates_file(p) for p in paths) else None


def _rng_state(distributed: bool) -> dict[str, Any]:
    """The generators ``Trainer._load_rng_state`` restores, under its keys (its CPU and CUDA ones)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all() if distributed else torch.cuda.random.get_rng_state()
    return state


def _fsync_files(folder: str) -> None:
    """Make every file under ``folder`` and the folder itself durable: what the trainer wrote there before the commit."""
    for where, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(where, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(where)
    fsync_dir(os.path.dirname(folder))


class _Hooks(TrainerCallback):
    """Forwards the two ``Trainer`` events the daemon needs to ``DatastatesTrainer``."""

    def __init__(self, fence: Callable[[], None], finish: Callable[[], None]) -> None:
        self._fence = fence
        self._finish = finish

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._fence()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish()


class DatastatesTrainer(Trainer):
    """A ``Trainer`` whose checkpoints the daemon copies and writes while training goes on.

    Takes ``Trainer``'s arguments, plus ``client`` (used as given, and left open) or
    ``client_options`` (``Client``'s keyword arguments for the one this trainer creates at
    its first save and closes when ``train()`` returns; the endpoint defaults to
    ``$DATASTATES_ENDPOINT``, else the daemon's default). ``output_dir`` must lie in the
    daemon's ``storage.roots``.

    The fence: the optimizer step after a save first waits until the daemon holds its copy
    (``Client.wait``), so the checkpoint is the state of its step. ``train()`` returns once
    every checkpoint is committed and durable, and raises a failed one as ``CommitError``.
    """

    def __init__(self, *args: Any, client: Client | None = None, client_options: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        self._client = client
        self._own_client = client is None
        self._client_options = dict(client_options or {})
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise InvalidRequestError("DatastatesTrainer does not save DeepSpeed or FSDP checkpoints: for DeepSpeed, use "
                                      "the plain Trainer with \"datastates_ckpt\": {} in the DeepSpeed config")
        if self.args.push_to_hub:
            raise InvalidRequestError("DatastatesTrainer cannot push_to_hub: its checkpoint files are written after "
                                      "_save_checkpoint returns")
        self._run_dir = self.args.output_dir
        self._commits = PendingCommits(self._run_dir, self._prune)
        self.add_callback(_Hooks(self._fence, self._finish))

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(**self._client_options)
        return self._client

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed checkpoint of ``output_dir``.

        The files of a committed checkpoint are verified (sizes and checksums) before ``Trainer``
        loads them, or as they are read (``READ_HERE``); the weights are read in place.
        """
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No committed checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            _verify(os.fspath(resume_from_checkpoint))
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write the JSON files, hand every other file to the daemon, and commit ``checkpoint-<step>``.

        Returns once the snapshot messages are sent; a commit that failed since the last
        save is raised here first, as CommitError.
        """
        self._commits.settle()
        tag = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(self._run_dir, tag)
        if os.path.lexists(os.path.join(folder, marker_name(tag))):
            raise InvalidRequestError(f"{folder} is a committed checkpoint already, which is never written into again: "
                                      "resume from it, train into another output_dir, or delete it first", path=folder)
        files: dict[str, Any] = {}
        if self.args.should_save:
            os.makedirs(folder, exist_ok=True)
            self._save_json(folder)
            _fsync_files(folder)
            files[WEIGHTS_NAME] = self.model.state_dict()
            files[TRAINING_ARGS_NAME] = self.args
        if not self.args.save_only_model:
            if self.args.should_save:
                files[OPTIMIZER_NAME] = self.optimizer.state_dict()
                files[SCHEDULER_NAME] = self.lr_scheduler.state_dict()
                if getattr(self.accelerator, "scaler", None) is not None:
                    files[SCALER_NAME] = self.accelerator.scaler.state_dict()
            distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
            rng_name = "rng_state.pth" if self.args.world_size <= 1 else f"rng_state_{self.args.process_index}.pth"
            files[rng_name] = _rng_state(distributed)
        for name, state in files.items():
            self.client.snapshot(state, os.path.join(folder, name), tag=tag)
        self._commits.add(tag, self.client.commit(tag))

    def _save_json(self, folder: str) -> None:
        """What ``Trainer`` writes as text: the trainer state, the model's config, the tokenizer."""
        if self.state.best_global_step:
            best = os.path.join(self._run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if isinstance(unwrapped, PreTrainedModel):  # so that from_pretrained(folder) works too
            unwrapped.config.save_pretrained(folder)
            if unwrapped.can_generate():
                unwrapped.generation_config.save_pretrained(folder)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(folder)
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name = type(cb).__name__
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """``Trainer``'s, but a datastates ``pytorch_model.bin`` is read into the model's own tensors."""
        if not self._load_weights(resume_from_checkpoint, self.model if model is None else model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_weights(self, folder: str, model: Any) -> bool:
        """Whether ``folder``'s weights were this trainer's to load, and are loaded: a datastates
        ``pytorch_model.bin`` read into ``model``'s own tensors, then ``load_state_dict`` as ``Trainer``
        calls it, which copies each tensor onto itself (skipped by torch). A folder with a safetensors
        file, which ``Trainer`` prefers, is left to it.
        """
        found = _ours(folder, WEIGHTS_NAME)
        if found is None or os.path.isfile(os.path.join(folder, SAFE_WEIGHTS_NAME)):
            return False
        self._fence()  # the load writes into the model's tensors, which a snapshot may still read
        state = load_any(found[0], "cpu", weights_only=True, model=model.state_dict())
        self._issue_warnings_after_load(model.load_state_dict(state, False))
        return True

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """``Trainer``'s, but datastates files are read by ``datastates.load`` (checksums checked as it reads).

        The optimizer has no state before its first step: its state is read fresh, onto the
        device ``Trainer`` would put it, and ``load_state_dict`` adopts those tensors.
        """
        found = None if checkpoint is None else _ours(checkpoint, OPTIMIZER_NAME, SCHEDULER_NAME)
        if found is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        device = self.args.device if self.args.world_size > 1 and self.args.device.type != "cpu" else "cpu"
        self.optimizer.load_state_dict(load_any(found[0], device, weights_only=True))
        self.lr_scheduler.load_state_dict(load_any(found[1], weights_only=True))

    def _load_best_model(self) -> None:
        """The best checkpoint may still be in flight: its commit first; its weights read in place."""
        self._commits.wait()
        if not self._load_weights(self.state.best_model_checkpoint, self.model):
            super()._load_best_model()

    def _fence(self) -> None:
        """Before an optimizer step: the daemon holds its copy of every checkpoint taken, so the step may change them."""
        if self._client is not None:
            self._client.wait()

    def _finish(self) -> None:
        """At the end of training: every checkpoint committed and durable, pruned, a failure raised as CommitError."""
        self._commits.wait()

    def _prune(self) -> None:
        """``save_total_limit``: delete the committed checkpoints older than that many newest, marker first."""
        limit = self.args.save_total_limit
        if not self.args.should_save or limit is None or limit <= 0:
            return
        spare = self._commits.tags  # still being written
        if self.state.best_model_checkpoint is not None:
            spare.add(os.path.basename(self.state.best_model_checkpoint))
        prune(self._run_dir, limit, spare=spare, accept=CHECKPOINT.fullmatch)
