"""Reading a framework's checkpoint file whoever wrote it: datastates, or ``torch.save`` before a job switched.

Framework adapters load through here, so a job that moved to datastates still resumes
from the files its earlier runs wrote with the framework's own ``torch.save``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

from datastates.client.reader import load
from datastates.protocol.errors import CorruptCheckpointError, UnsupportedFormatError
from datastates.protocol.format import INDEX_AT, index_at

MapLocation = (str | torch.device | Mapping[str, str] | Callable[[torch.UntypedStorage, str], torch.UntypedStorage]
               | None)


def is_datastates_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts as a datastates file of any format; a ``torch.save`` zip has no datastates index."""
    with open(path, "rb") as f:
        first = f.read(INDEX_AT)
    try:
        index_at(first, os.fspath(path))
    except UnsupportedFormatError:
        return False
    except CorruptCheckpointError:  # truncated before its index: load then says so
        pass
    return True


def load_any(path: str | os.PathLike, map_location: MapLocation = None, weights_only: bool | None = None) -> Any:
    """The state at ``path``; ``weights_only`` None takes each reader's safe default, as ``torch.load`` does.

    A datastates file's tensors are read onto the CPU, where ``torch.load`` puts a storage
    saved there: a ``map_location`` of torch's other forms (a callable such as
    ``lambda storage, loc: storage``, a dict of locations) is asked where a CPU storage goes.
    """
    if not is_datastates_file(path):
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if callable(map_location):
        map_location = map_location(torch.UntypedStorage(0), "cpu").device
    elif isinstance(map_location, Mapping):
        map_location = map_location.get("cpu")
    if map_location is not None and torch.device(map_location).type == "cpu":
        map_location = None
    return load(path, map_location, weights_only=weights_only is not False)
