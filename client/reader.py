"""Reading checkpoints back: ``load`` a file, bitwise (``latest`` is in client/locate.py)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from datastates.protocol.format import FileHeader, ZipLayout
from datastates.protocol.storage.s3 import one_read

from .entries import Entries
from .filecheck import (  # noqa: F401  (verify: re-exported)
    check_identity,
    check_storage,
    check_views,
    check_zip,
    malformed,
    read_header,
    region_buffer,
    verify,
)
from .into import load_into
from .stream import Stream

MapLocation = str | torch.device | None


def _read_data(path: str, header: FileHeader, layout: ZipLayout | None, span: tuple[int, int],
               verify: bool) -> torch.UntypedStorage:
    """The data region as one storage, every tensor's storage a slice of it: read into one fresh buffer (or a tmpfs
    file's own pages mapped), each piece checked as it lands (client/stream.py)."""
    start, end = span
    if end <= start:
        return torch.UntypedStorage(0)
    buf = region_buffer(path, start, end)
    Stream(path, header, layout, span, None, verify).run(np.frombuffer(buf, dtype=np.uint8))
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


class _Restore(Entries):
    """A fresh load's RestoreContext: every storage a slice of the data region, read and checked once."""

    def __init__(
        self, path: str, data: torch.UntypedStorage, header: FileHeader, verify: bool, device: torch.device | None,
        weights_only: bool = False,
    ) -> None:
        super().__init__(path, header, weights_only)
        self._data = data
        self._verify = verify
        self._device = device
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.region = memoryview(torch.empty(0, dtype=torch.uint8).set_(data).numpy()) if data.nbytes() else \
            memoryview(b"")
        """The data region as bytes, for the bounds and checksum checks (filecheck.check_storage)."""

    def storage(self, index: int) -> torch.UntypedStorage:
        if index not in self._storages:
            check_storage(self.path, self.header, index, self.region, self._verify)
            rec = self.header.storages[index]
            self._storages[index] = self._data[rec.offset:rec.offset + rec.nbytes]
        return self._storages[index]

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._device is None or self._device.type == "cpu" else tensor.to(self._device)


def load(path: str | os.PathLike, map_location: MapLocation = None, *, into: Any = None, strict: bool = True,
         verify: bool = True, weights_only: bool = True) -> Any:
    """The state saved at ``path``, bitwise as it was snapshotted.

    With ``into`` (a state of the same structure: ``model.state_dict()``, a dict of them),
    each tensor's bytes are read straight into ``into``'s tensor at the same key, on the CPU
    or a GPU; values that are not tensors are put into ``into``'s containers, and ``into`` is
    returned. A key one side lacks, or a tensor of another shape or dtype, raises
    StateMismatchError naming the key before anything is written; ``strict=False`` adds the
    checkpoint's keys that ``into`` lacks (freshly read, onto ``map_location``) instead.
    See client/into.py.

    Without ``into``, the data region is read in one pass of large parallel reads into one
    buffer, and every storage is a slice of it, as with ``torch.load(mmap=True)``: no
    per-tensor allocation and no second copy.

    With ``verify`` (the default) every byte is checked against its checksum, before any of
    it reaches a tensor of ``into``. Refuses, with CorruptCheckpointError naming the file and
    the tensor, a file of the wrong size, a truncated one, or one whose header or data
    checksums do not match.
    By default (``weights_only=True``, as ``torch.load`` since torch 2.6) the skeleton goes
    through torch's safe unpickler, which builds tensors, containers, plain values and the
    objects training states commonly hold (numpy arrays and dtypes, RNG states,
    ``torch.Size``, ``argparse.Namespace``; more with ``torch.serialization.add_safe_globals``),
    and raises WeightsOnlyError for anything else. ``weights_only=False`` unpickles anything,
    which runs code the file's author chose: only for files you trust.
    """
    path = os.fspath(path)
    with one_read(whole=True):  # an object's reads share one ETag, one read of its head and tail
        return _load(path, torch.device(map_location) if map_location is not None else None, into, strict, verify,
                     weights_only)


def _load(path: str, device: torch.device | None, into: Any, strict: bool, verify: bool, weights_only: bool) -> Any:
    if into is not None:
        return load_into(path, into, device, new_key=lambda _: not strict, verify=verify, weights_only=weights_only)
    header, base, end, layout = read_header(path)
    check_identity(path, header)
    if verify:  # what torch.load would rebuild from the file is what this load rebuilds
        check_views(path, header)
        if layout is not None:
            check_zip(path, header, layout, None)  # the data region's zip headers: as it streams
    data = _read_data(path, header, layout if verify else None, (base, end), verify)
    return _Restore(path, data, header, False, device, weights_only).entry(header.root)
