"""DeepSpeed's checkpoint engine, through datastatesd: ``engine.save_checkpoint`` hands the state to the daemon.

DeepSpeed (0.19) builds its checkpoint engine from the config alone and knows no
third-party engine: ``checkpoint.writer`` picks its own fast or decoupled writers, and
``datastates_ckpt`` imports ``datastates.CheckpointEngine``, the API of the separate
DataStates-LLM package, which this package does not provide (``deepspeed.initialize``
then fails). So a job switches with one assignment after ``deepspeed.initialize``, before
its first ``save_checkpoint``::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, ...)
    engine.checkpoint_engine = DatastatesCheckpointEngine(decoupled=True)

DeepSpeed chose its data-parallel writers at ``initialize`` from the default engine's
``is_data_parallel_writer``, which this engine keeps (data-parallel rank 0), so do not
combine it with a ``checkpoint.writer`` config. ``load_checkpoint`` reads datastates files
and, for resuming a job that switched, files written by ``torch.save``.

**In place.** Given the model (``DatastatesCheckpointEngine(model=engine)``: the DeepSpeed
engine or its module), ``load_checkpoint`` reads the model states file's ``module`` part
straight into the module's own tensors (integrations/loading.py), and DeepSpeed's own
``module.load_state_dict`` then copies each tensor onto itself, which torch skips. DeepSpeed
builds the checkpoint engine without the model, so without ``model`` every file is read
fresh and copied in, as before. Read fresh either way: the optimizer files (DeepSpeed's
ZeRO code rebuilds its flat partitions from the file's, merged or split when the
data-parallel degree changed: no state dict of the optimizer's own the file could be read
into), any file without ``module``, and a ``module`` that does not fit the model's
``state_dict()`` key for key (ZeRO-3's partitioned parameters, ``exclude_frozen_parameters``,
a model-parallel layout of another degree), which DeepSpeed then loads as before.

Every rank calls ``commit`` (DeepSpeed does, even on ranks that saved nothing), and each
commits the tag to the daemon: in a job of many ranks the daemon marks the tag committed
once all of them have; a job of one commits at once. The daemon writes the ``latest`` file
beside the tag folder itself, after the tag's marker, whatever ``save_latest`` says.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as exc:  # datastates itself never needs DeepSpeed; only this module does
    raise ImportError(
        f"datastates.integrations.deepspeed needs DeepSpeed (pip install deepspeed): {exc}"
    ) from exc

from datastates.client.client import Client
from datastates.protocol.errors import CommitError, InvalidRequestError
from datastates.protocol.format import check_tag

from .loading import MapLocation, load_any


class DatastatesCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` whose ``save`` is a ``Client.snapshot``: the daemon copies and writes.

    ``decoupled=False`` (the default): ``commit`` runs at the end of ``save_checkpoint``, so
    the call returns with the checkpoint durable, as with DeepSpeed's own engine; the
    trainer is spared serializing and writing in its process, not the wait.

    ``decoupled=True``: DeepSpeed defers ``commit`` to the next ``engine.step()``, just
    before the optimizer step, the first in-place change of the saved tensors. The daemon
    copies and writes while the next forward and backward run, and the step waits only
    for what is left. A forward pass that changes saved tensors in place (BatchNorm
    statistics) must call ``wait()`` first. A tag saved last commits at the next step,
    the next ``save_checkpoint``, or ``cleanup()`` (``engine.destroy()`` calls it).

    Only CPU tensors are copied lazily by the daemon; CUDA tensors in the state (a model
    trained on the GPU) are pickled by torch in the trainer, during ``save``.

    Either way ``commit`` first waits until the daemon holds its copy (``Client.wait``),
    then until the tag is durable, and returns True, DeepSpeed's sign that it may write
    ``latest``. ``client`` is used as given (and left open); otherwise one is created at
    the first save or commit from ``client_options`` (``Client``'s keyword arguments; the
    endpoint defaults to ``$DATASTATES_ENDPOINT``, else the daemon's default) and closed by
    ``cleanup()``.

    ``model`` (the DeepSpeed engine, or its module): ``load`` reads a model states file's
    ``module`` straight into the module's own tensors (see the module's docstring).
    """

    def __init__(self, config_params: Any = None, *, client: Client | None = None, decoupled: bool = False,
                 model: torch.nn.Module | None = None, **client_options: Any) -> None:
        super().__init__(config_params)
        self.module = model.module if isinstance(model, DeepSpeedEngine) else model
        """The module whose own tensors a model states file is read into; None: every file read fresh."""
        self.name = "DatastatesCheckpointEngine"
        self.decoupled = decoupled
        self._client = client
        self._own_client = client is None
        self._client_options = client_options
        self._open: CheckpointCommitInfo | None = None
        """The checkpoint ``create`` began and ``commit`` has not finished yet."""

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(**self._client_options)
        return self._client

    def create(self, info: CheckpointCommitInfo) -> None:
        """Begin checkpoint ``info.tag``; a decoupled one still waiting for its step is committed first."""
        check_tag(info.tag)  # before any file is saved, not at the first snapshot
        if self._open is not None and self.decoupled:
            self.commit(self._open)
        self._open = info

    def save(self, state_dict: Any, path: str) -> None:
        """Hand ``state_dict`` to the daemon, to be written to ``path``; returns once the message is sent."""
        if self._open is None:
            raise InvalidRequestError(f"save({path!r}) outside a checkpoint: create(info) comes first", path=path)
        self.client.snapshot(state_dict, path, tag=self._open.tag)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the daemon holds its copy of everything saved, so the tensors may change again."""
        if self._client is not None:
            self._client.wait(timeout)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait for the daemon's copy, then until ``info.tag`` is durable and committed; True."""
        if self._open is None or info.tag != self._open.tag:
            open_tag = None if self._open is None else self._open.tag
            raise CommitError(f"commit of tag {info.tag!r}, but the checkpoint begun by create() is {open_tag!r}",
                              tag=info.tag)
        self._open = None
        self.client.wait()
        self.client.commit(info.tag).result()
        return True

    def load(self, path: str, map_location: MapLocation = None) -> Any:
        """The state at ``path``, a datastates file or one ``torch.save`` wrote.

        DeepSpeed copies what it loads into the live tensors, and with ``model`` the load
        writes into them itself, so a snapshot still being copied is waited for first. A
        callable ``map_location`` (DeepSpeed passes ``lambda storage, loc: storage``) is asked
        where it puts a CPU storage, and the tensors read fresh are moved there; the
        ``module`` part of a model states file, with ``model``, is read into the module's
        tensors wherever they are.
        """
        self.wait()
        # DeepSpeed's states hold its own objects (LossScaler, ZeroStageEnum), and DeepSpeed trusts its checkpoint
        # folder as its TorchCheckpointEngine does (weights_only=False): so does this engine, as DeepSpeed's.
        model = None if self.module is None else self.module.state_dict()
        return load_any(path, map_location, weights_only=False, model=model, under="module")

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """What DeepSpeed's next step commits, when decoupled."""
        return self._open

    def is_decoupled(self) -> bool:
        return self.decoupled

    def cleanup(self) -> None:
        """Commit a decoupled checkpoint still waiting for its step, then close the client this engine created."""
        if self._open is not None and self.decoupled:
            self.commit(self._open)
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None
