"""Reading a framework's checkpoint file whoever wrote it: datastates, or ``torch.save`` before a job switched.

Framework adapters load through here, so a job that moved to datastates still resumes
from the files its earlier runs wrote with the framework's own ``torch.save``.

**In place.** Given the model's ``state_dict()``, the part of a datastates file that is the
model's state dict is read straight into the model's own tensors (``datastates.load(path,
into=...)``, client/reader/restore.py), and the state handed back holds those very tensors there.
The framework then calls ``load_state_dict`` itself, as it always does; torch's
``param.copy_(src)`` returns at once when ``src`` is the parameter's own memory, so that
copy costs nothing, and the state crosses memory once instead of twice, without a fresh
allocation of the model.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

import torch

from datastates.client.reader.restore import key_name, load, load_into
from datastates.client.reader.source import open_source
from datastates.protocol.errors import CorruptCheckpointError, StateMismatchError, UnsupportedFormatError
from datastates.protocol.format import INDEX_AT, index_at

log = logging.getLogger(__name__)

MapLocation = (str | torch.device | Mapping[str, str] | Callable[[torch.UntypedStorage, str], torch.UntypedStorage]
               | None)


def is_datastates_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts as a datastates file of any format; a ``torch.save`` zip has no datastates index."""
    with open_source(os.fspath(path)) as source:
        first = source.pread(INDEX_AT, 0)
    try:
        index_at(first, os.fspath(path))
    except UnsupportedFormatError:
        return False
    except CorruptCheckpointError:  # truncated before its index: load then says so
        pass
    return True


def load_any(path: str | os.PathLike, map_location: MapLocation = None, weights_only: bool | None = None, *,
             model: dict[str, torch.Tensor] | None = None, under: str | None = None) -> Any:
    """The state at ``path``; ``weights_only`` None takes each reader's safe default, as ``torch.load`` does.

    A datastates file's tensors are read onto the CPU, where ``torch.load`` puts a storage
    saved there: a ``map_location`` of torch's other forms (a callable such as
    ``lambda storage, loc: storage``, a dict of locations) is asked where a CPU storage goes.

    ``model``, a module's ``state_dict()``: the file's model part, ``state[under]`` (the
    whole file when ``under`` is None), is read into its tensors wherever they are (CPU or
    GPU; ``map_location`` applies to the rest), and the state returned holds ``model``
    itself there. The file's other top-level keys are read fresh. A file without ``under``,
    or whose model part does not fit ``model`` (a key one side lacks, another shape or
    dtype: a partial state dict a framework loads with ``strict=False``, ZeRO-3's
    partitioned parameters), is read fresh, with nothing written into ``model``, the misfit
    logged: the framework's own ``load_state_dict`` then judges it as before. A file
    ``torch.save`` wrote is read by ``torch.load``, as without ``model``.
    """
    if not is_datastates_file(path):
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if callable(map_location):
        map_location = map_location(torch.UntypedStorage(0), "cpu").device
    elif isinstance(map_location, Mapping):
        map_location = map_location.get("cpu")
    if map_location is not None and torch.device(map_location).type == "cpu":
        map_location = None
    safe = weights_only is not False
    if model is not None:
        state = _into_model(os.fspath(path), map_location, safe, model, under)
        if state is not None:
            return state
    return load(path, map_location, weights_only=safe)


def _into_model(path: str, map_location: str | torch.device | None, safe: bool, model: dict[str, torch.Tensor],
                under: str | None) -> Any:
    """The state at ``path`` with its model part read into ``model``; None where that part does not fit it."""
    into = model if under is None else {under: model}
    device = torch.device(map_location) if map_location is not None else None
    try:
        return load_into(path, into, device, new_key=lambda keys: under is not None and keys[0] != under,
                         verify=True, weights_only=safe)
    except StateMismatchError as exc:  # raised before anything was written
        if under is None or exc.detail.get("key") != key_name((under,)):  # not merely a file of another kind
            log.warning("%s: read fresh, not into the model's own tensors: %s", path, exc.message)
        return None
