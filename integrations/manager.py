"""Checkpointing a plain PyTorch loop through datastatesd: save every K steps, resume, keep the last N.

One ``CheckpointManager`` per rank. Each save writes this rank's whole training state
(model, optimizer, scheduler, data order, RNG, extra values) to ``root/step<8 digits>/rank<R>.pt``
and commits the tag; the trainer pays for a tree walk and one message, because the copy
happens while the next forward and backward run and the commit resolves in the background.
"""

from __future__ import annotations

import logging
import os
import random
import re
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import torch

from datastates.client.client import Client
from datastates.client.locate import again_if_deleted
from datastates.client.reader.restore import load_into
from datastates.integrations.pending_commits import PendingCommits
from datastates.protocol.retention import prune
from datastates.protocol.tags import committed_tags
from datastates.protocol.errors import InvalidRequestError

log = logging.getLogger(__name__)

_TAG = re.compile(r"step\d{8,}")
"""The tags this manager writes: the only ones it restores, and the only ones its pruning may delete."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


def _rng_state() -> dict[str, Any]:
    """Every generator a step may draw from implicitly (dropout, augmentation, shuffles)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_initialized():  # only then can CUDA have drawn anything; asking would create a context
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Save, restore and prune one rank's training state under ``root``.

    ``every``: ``maybe_save(step)`` saves when ``step % every == 0``. ``keep_last``: once a
    newer tag is known committed, rank 0 deletes the tags older than the ``keep_last``
    newest committed ones (None keeps every tag). ``data_loader`` is anything with
    ``state_dict()``/``load_state_dict()`` (a torchdata ``StatefulDataLoader``, a sampler);
    ``extra`` is a dict of further values, saved as it is at each save and updated in
    place by ``restore()``. ``rank`` defaults to the client's rank in a job of several, else ``$RANK``, else 0.

    The manager fences ``optimizer.step()`` with ``client.protect``. Anything else that
    changes checkpointed tensors in place before the step (an EMA, BatchNorm statistics
    in a forward pass) needs ``client.wait()`` first.
    """

    def __init__(
        self, client: Client, root: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None = None, data_loader: Stateful | None = None, extra: dict[str, Any] | None = None,
        keep_last: int | None = None, every: int = 1, rank: int | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise InvalidRequestError(f"keep_last: {keep_last} would delete the newest committed tag; use >= 1 or None")
        if every < 1:
            raise InvalidRequestError(f"every: {every} is not a positive number of steps")
        for name, obj in (("scheduler", scheduler), ("data_loader", data_loader)):
            missing = [m for m in ("state_dict", "load_state_dict") if obj is not None and not callable(getattr(obj, m, None))]
            if missing:
                raise InvalidRequestError(f"{name}: a {type(obj).__name__} has no {' or '.join(f'{m}()' for m in missing)}, "
                                          "so its position could not be saved and restored; pass one that has both "
                                          f"(a torchdata StatefulDataLoader, a stateful sampler) or {name}=None")
        self.client = client
        self.root = os.path.abspath(os.fspath(root))
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.data_loader = data_loader
        self.extra = extra
        self.keep_last = keep_last
        self.every = every
        if rank is None:  # the client's ranks come from torchrun or an srun step; $RANK alone covers other launchers
            rank = client.ranks.rank if client.ranks.world_size > 1 else int(os.environ.get("RANK", "0"))
        self.rank = rank
        self._commits = PendingCommits(self.root, self._prune)
        self._fence = client.protect(optimizer)

    @staticmethod
    def tag(step: int) -> str:
        return f"step{step:08d}"

    def path(self, tag: str) -> str:
        """This rank's file of ``tag``."""
        return os.path.join(self.root, tag, f"rank{self.rank}.pt")

    def maybe_save(self, step: int) -> Future | None:
        return self.save(step) if step % self.every == 0 else None

    def save(self, step: int) -> Future:
        """Snapshot this rank's state as of ``step`` and commit it; returns the commit's future.

        Returns once the snapshot message is sent: the daemon copies while training goes
        on, and the commit resolves later. A commit that failed since the last save is
        raised here, as CommitError, before anything new is saved.
        """
        self._commits.settle()
        state: dict[str, Any] = {
            "step": step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": _rng_state(),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.data_loader is not None:
            state["data_loader"] = self.data_loader.state_dict()
        if self.extra is not None:
            state["extra"] = self.extra
        tag = self.tag(step)
        self.client.snapshot(state, self.path(tag), tag=tag)
        fut = self.client.commit(tag)
        self._commits.add(tag, fut)
        return fut

    def restore(self, *, weights_only: bool = True) -> int | None:
        """Load this manager's newest committed tag under ``root`` into the objects; its step, or None if there is none.

        In place: the model's and the optimizer's existing tensors get the file's bytes straight
        (``datastates.load(path, into=...)``), with no fresh copy of the state and no second copy
        by ``load_state_dict``; a model whose keys, shapes or dtypes differ from the file's is
        refused (StateMismatchError) before anything is written. An optimizer that has not
        stepped yet (no state) gets the file's state freshly read, on its parameters' devices.
        Only tags named as ``tag()`` names them count: others under ``root`` (another tool's
        ``global_step1000``) are not this manager's to restore. ``weights_only`` as in
        ``datastates.load``: safe by default; False only for files you trust.
        """
        self.client.wait()  # the restore writes into tensors a pending snapshot may still be reading
        newest = again_if_deleted(lambda: self._load_newest(weights_only), self.root)
        if newest is None:
            return None
        path, state = newest
        self.optimizer.load_state_dict(state["optimizer"])  # its tensors are the optimizer's own, or fresh ones
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.data_loader is not None:
            self.data_loader.load_state_dict(state["data_loader"])
        if self.extra is not None:
            self.extra.clear()
            self.extra.update(state["extra"])
        _set_rng_state(state["rng"])
        log.info("restored step %d from %s", state["step"], path)
        return state["step"]

    def _load_newest(self, weights_only: bool) -> tuple[str, dict[str, Any]] | None:
        """This rank's file of the newest committed tag, read into the objects; None if no tag is committed."""
        found = committed_tags(self.root, own_folder=True, accept=_TAG.fullmatch)
        if not found:
            return None
        tag, path = found[0].tag, self.path(found[0].tag)
        if os.path.basename(path) not in {f.path for f in found[0].marker.files}:
            raise InvalidRequestError(f"tag {tag} under {self.root} is committed without {os.path.basename(path)}: "
                                      "it was saved by a job of fewer ranks", path=path)
        into: dict[str, Any] = {"step": None, "rng": None, "model": self.model.state_dict(),
                                "optimizer": {"state": self.optimizer.state_dict()["state"]}}
        for key, given in (("scheduler", self.scheduler), ("data_loader", self.data_loader), ("extra", self.extra)):
            if given is not None:  # the file must hold it: its value replaces the None
                into[key] = None
        return path, load_into(path, into, None, new_key=lambda keys: keys[0] != "model", verify=True,
                               weights_only=weights_only)

    def close(self, timeout: float | None = None) -> None:
        """Wait for every commit, prune, and remove the fence; raises a failed commit as CommitError.

        Leaves the client open: it belongs to the caller.
        """
        try:
            self._commits.wait(timeout)
        finally:
            self._fence.remove()

    def _prune(self) -> None:
        """Delete this manager's committed tags older than the ``keep_last`` newest (see protocol/retention.py)."""
        if self.rank == 0 and self.keep_last is not None:  # tags being saved again: their files are about to be replaced
            prune(self.root, self.keep_last, spare=self._commits.tags, accept=_TAG.fullmatch)
