"""Reading a framework's checkpoint file, whichever engine wrote it: datastates' own, or ``torch.save`` before a switch."""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from datastates.client.reader import load
from datastates.protocol.errors import UnsupportedFormatError
from datastates.protocol.format import INDEX_AT, index_at

MapLocation = str | torch.device | Callable[[torch.UntypedStorage, str], torch.UntypedStorage] | None
"""What frameworks pass to ``torch.load``: a device, or a callable (DeepSpeed passes ``lambda storage, loc: storage``)."""


def is_datastates_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` was written by datastatesd (either format), from its first bytes."""
    with open(path, "rb") as f:
        first = f.read(INDEX_AT)
    try:
        index_at(first, os.fspath(path))
    except UnsupportedFormatError:
        return False
    return True


def load_file(path: str | os.PathLike, map_location: MapLocation = None, *, weights_only: bool) -> Any:
    """The state in ``path``: datastates' reader for its own files (parallel reads, checksums), ``torch.load`` else.

    A callable ``map_location`` is asked where it puts a CPU storage, and the tensors go there.
    """
    if not is_datastates_file(path):
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if callable(map_location):
        device = map_location(torch.UntypedStorage(0), "cpu").device
        map_location = None if device.type == "cpu" else device
    return load(path, map_location, weights_only=weights_only)
