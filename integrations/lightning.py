"""PyTorch Lightning's checkpoint IO through datastatesd: ``Trainer(plugins=[DatastatesCheckpointIO()])``.

Every file Lightning saves (``ModelCheckpoint``'s ``epoch=0-step=10.ckpt``, ``last.ckpt``,
``trainer.save_checkpoint``) is handed to the daemon, which copies it while training goes
on and writes it at Lightning's own path, as a torch-compatible zip: ``torch.load`` and
``LightningModule.load_from_checkpoint`` read it as they read Lightning's own files.

**Tags.** Lightning puts many files into one folder and rotates them one by one, so each
file is a tag of its own, named after the file (``tag_of``); its marker
``datastates-commit.<file name>.json`` sits beside it, and ``datastatesctl verify <folder>``
checks them all. Saving a path again (``last.ckpt``) first withdraws that file's marker:
the daemon switches a new version in atomically only for a tag with a folder of its own
(daemon/resave.py), and refuses to write over a file a marker lists. Until the new file
is committed, the path holds the previous file, whole, but not committed; at no moment does
a marker name bytes other than the file's. ``ModelCheckpoint(save_last="link")`` makes
``last.ckpt`` a link to the newest top-k file instead, which is never saved again.

**Fence.** Lightning calls ``optimizer.step(closure)``, and the closure runs forward,
backward, ``on_before_optimizer_step`` and gradient clipping inside the step. A global
optimizer step pre-hook therefore runs *before* the forward pass; waiting there would
leave the daemon's copy nothing to overlap. Instead the pre-hook wraps the closure so
that ``Client.wait()`` runs after it returns and before the update, the first in-place
change of parameters and optimizer state; a step without a closure waits at once.
A model whose forward pass changes saved tensors in place (BatchNorm running statistics
in training mode) fences before it itself::

    def on_train_batch_start(self, batch, batch_idx):   # in the LightningModule
        self.trainer.strategy.checkpoint_io.wait()

**In place.** Lightning hands a ``CheckpointIO`` only a path, never the model, so the
plugin is told it: ``DatastatesCheckpointIO(module=model)``, the module given to
``fit``/``validate``/``test``. ``load_checkpoint`` then reads the file's ``state_dict``
straight into the module's own tensors (integrations/loading.py), and Lightning's
``load_state_dict`` copies each tensor onto itself, which torch skips. Read fresh, as
without ``module``: the optimizer states (Lightning reads the file before it builds the
optimizers, which hold no state before their first step anyway: nothing to read into), a
file without ``state_dict``, one whose ``state_dict`` does not fit the module key for key
(what ``strict_loading=False`` is for), and a file ``torch.save`` wrote. An
``on_load_checkpoint`` that swaps two ``state_dict`` entries would copy one over the
other, both being the module's own tensors: use a plugin without ``module`` there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

try:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    except ImportError as exc:  # datastates itself never needs Lightning; only this module does
        raise ImportError(
            f"datastates.integrations.lightning needs PyTorch Lightning (pip install pytorch-lightning): {exc}"
        ) from exc

from datastates.client.client import Client
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import InvalidRequestError, PathNotAllowedError
from datastates.protocol.fileio import fsync_dir, remove
from datastates.protocol.format import TAG_MAX, CommitMarker, check_tag, marker_name
from datastates.protocol.retention import delete_tag
from datastates.protocol.tags import CommittedTag

from .pending_commits import PendingCommits
from .loading import MapLocation, load_any

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")


def tag_of(path: str) -> str:
    """The tag of the Lightning file at ``path``: its name, or, for a name no tag may be, a safe form of it and its hash.

    A name some folder above the file also bears gets the hashed form too: the daemon would
    put the marker in that folder, as a tag's own.
    """
    name = os.path.basename(path)
    if name not in os.path.dirname(path).split(os.sep):
        try:
            return check_tag(name)
        except InvalidRequestError:
            pass
    digest = hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return check_tag(f"{_UNSAFE.sub('_', name).lstrip('.-')[:TAG_MAX - 32] or 'file'}-{digest}")


class DatastatesCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` whose ``save_checkpoint`` is a ``Client.snapshot`` and ``commit``.

    ``save_checkpoint`` returns once the snapshot message is sent; the daemon copies while
    the next forward and backward run, and each optimizer step waits first for what is
    left. A forward pass that changes saved tensors in place (BatchNorm running statistics
    in training mode) must call ``wait()`` before it, e.g. in ``on_train_batch_start``.
    A failed commit is raised as ``CommitError`` at the next save, load or removal, or at
    ``teardown()``, which Lightning calls at the end of ``fit``/``validate``/``test`` and
    which waits until every checkpoint is durable and committed.

    ``client`` is used as given (and left open); otherwise one is created at the first save
    from ``endpoint`` (default as ``Client``: ``$DATASTATES_ENDPOINT``, else the daemon's)
    and ``client_options`` (``Client``'s keywords), and closed by ``teardown()``. Lightning
    saves and removes checkpoints on global rank 0 only, so that client is a job of one
    rank (``ranks=Ranks()``, whatever torchrun's variables say): a tag waits for no rank
    that never commits it. Other ranks only load, and never connect.

    ``module``: the LightningModule the trainer restores, whose own tensors ``load_checkpoint``
    reads the file's ``state_dict`` into (see the module's docstring); None reads it fresh.
    """

    def __init__(self, endpoint: str | None = None, *, client: Client | None = None,
                 module: torch.nn.Module | None = None, **client_options: Any) -> None:
        self.module = module
        self._client = client
        self._own_client = client is None
        self._client_options = {"endpoint": endpoint, "ranks": Ranks(), **client_options}
        self._commits = PendingCommits("the Lightning checkpoint folder")
        """Commits not yet taken in, by tag (one per file); each outcome is reported once."""
        self._fence: Any = None
        """The optimizer step pre-hook's handle, while a client is open."""

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(**self._client_options)
        if self._fence is None:
            self._fence = register_optimizer_step_pre_hook(self._fence_step)
        return self._client

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Hand ``checkpoint`` to the daemon for ``path`` and commit it; returns once the messages are sent."""
        if storage_options is not None:
            raise InvalidRequestError(f"save_checkpoint(storage_options={storage_options!r}): {type(self).__name__} "
                                      "takes none; the daemon's node config says where and how files are written")
        path = os.path.abspath(os.fspath(path))
        tag = tag_of(path)
        client = self.client  # connected before anything is withdrawn
        self._commits.wait(tags={tag})  # a save of the same tag still in flight would be versioned, not replaced
        _withdraw(path, tag)
        client.snapshot(checkpoint, path, tag=tag)
        self._commits.add(tag, client.commit(tag))

    def load_checkpoint(self, path: Any, map_location: MapLocation = None, weights_only: bool | None = None) -> Any:
        """The checkpoint at ``path``: a datastates file, or one ``torch.save`` wrote (a job that switched).

        A save of ``path`` still in flight is waited for first. ``map_location`` None puts the
        tensors on the CPU, as Lightning's ``TorchCheckpointIO`` does. ``weights_only`` None is
        safe loading, as Lightning's own ``torch.load`` has it; pass ``weights_only=False`` to
        ``trainer.fit`` only for files you trust. With ``module``, the ``state_dict`` is read
        into the module's own tensors, wherever they are, once every snapshot is copied.
        """
        path = os.path.abspath(os.fspath(path))
        self._commits.wait(tags={tag_of(path)})
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        model = None
        if self.module is not None:
            self.wait()  # the load writes into the module's tensors, which a snapshot of another file may still read
            model = self.module.state_dict()
        return load_any(path, "cpu" if map_location is None else map_location, weights_only, model=model,
                        under="state_dict")

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: its marker first, made durable, then the file.

        A marker that lists other files too is not this plugin's: that is refused, since
        deleting it would withdraw their commit.
        """
        path = os.path.abspath(os.fspath(path))
        tag, folder = tag_of(path), os.path.dirname(path)
        self._commits.wait(tags={tag})  # its marker lands first
        marker = CommitMarker.read(os.path.join(folder, marker_name(tag)))
        if marker is not None:
            if [f.path for f in marker.files] != [os.path.basename(path)]:
                raise PathNotAllowedError(f"{path}: its marker {marker_name(tag)} lists {[f.path for f in marker.files]}, "
                                          "not this file alone; not deleted", path=path)
            delete_tag(CommittedTag(tag, folder, marker), folder)
        elif os.path.isfile(path):  # a file torch.save wrote, before the job switched
            remove(path, trusted=folder)
            fsync_dir(folder, trusted=folder)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the daemon holds its copy of every checkpoint saved, so their tensors may change again."""
        if self._client is not None:
            self._client.wait(timeout)

    def teardown(self) -> None:
        """Wait until every checkpoint is durable and committed, then close; raises a failed commit as CommitError."""
        try:
            self._commits.wait()
        finally:
            if self._fence is not None:
                self._fence.remove()
                self._fence = None
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None

    def _fence_step(self, _optimizer: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The step pre-hook: ``wait()`` after the step's closure (forward and backward), before the update.

        ``args`` is ``step``'s own: the optimizer first, then a positional closure if any.
        """
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.wait()
            return None

        def fenced() -> Any:
            result = closure()
            self.wait()
            return result

        if "closure" in kwargs:
            return args, {**kwargs, "closure": fenced}
        return (args[0], fenced, *args[2:]), kwargs


def _withdraw(path: str, tag: str) -> None:
    """Before ``path`` is saved again, withdraw its committed marker: the file stays, whole, until the new one replaces it."""
    folder = os.path.dirname(path)
    marker = os.path.join(folder, marker_name(tag))
    if os.path.lexists(marker):
        remove(marker, trusted=folder)
        fsync_dir(folder, trusted=folder)


def _also_for_unified_lightning() -> None:
    """Make the plugin pass the unified ``lightning`` package's ``isinstance`` check too, when both packages are installed."""
    if importlib.util.find_spec("lightning") is None or importlib.util.find_spec("lightning_fabric") is None:
        return
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as UnifiedCheckpointIO

    if not issubclass(DatastatesCheckpointIO, UnifiedCheckpointIO):
        UnifiedCheckpointIO.register(DatastatesCheckpointIO)


_also_for_unified_lightning()
