"""Reading checkpoints back: ``load`` a file, bitwise (``latest`` is in client/locate.py)."""

from __future__ import annotations

import os
from typing import Any

import torch

from datastates.protocol.descriptors import EMPTY, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, UnsupportedFormatError
from datastates.protocol.format import FileHeader
from datastates.protocol.providers import get_provider

from .filecheck import (  # noqa: F401  (verify: re-exported)
    check_identity,
    check_storage,
    check_views,
    check_zip,
    malformed,
    read_header,
    read_region,
    verify,
)

MapLocation = str | torch.device | None


def _read_data(path: str, start: int, end: int) -> torch.UntypedStorage:
    """Bytes ``start..end`` of the file as one storage (``read_region``), every tensor's storage a slice of it."""
    buf = read_region(path, start, end)
    if buf is None:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


class _Restore:
    """The RestoreContext of one file: its storages, read and checked once, and its entries."""

    def __init__(
        self, path: str, data: torch.UntypedStorage, header: FileHeader, verify: bool, device: torch.device | None,
        weights_only: bool = False,
    ) -> None:
        self.path = path
        self.weights_only = weights_only
        self._data = data
        self._header = header
        self._verify = verify
        self._device = device
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._entries: dict[int, Any] = {}
        self._restoring: set[int] = set()
        self._sources = [SourceDesc(kind=EMPTY, handle="", nbytes=rec.nbytes) for rec in header.storages]
        """The storages as a provider's ``plan`` sees a snapshot's sources: only their sizes matter to it."""
        self.region = memoryview(torch.empty(0, dtype=torch.uint8).set_(data).numpy()) if data.nbytes() else \
            memoryview(b"")
        """The data region as bytes, for the bounds and checksum checks (filecheck.check_storage)."""

    def storage(self, index: int) -> torch.UntypedStorage:
        if index not in self._storages:
            check_storage(self.path, self._header, index, self.region, self._verify)
            rec = self._header.storages[index]
            self._storages[index] = self._data[rec.offset:rec.offset + rec.nbytes]
        return self._storages[index]

    def entry(self, index: int) -> Any:
        """Entry ``index``, restored once, after its provider checked it as the daemon does at admission.

        A file is as untrusted as a client: a tensor's view beyond its storage, an unknown
        dtype or a skeleton that refers to itself is refused with CorruptCheckpointError
        naming the entry, never met as a torch error or a RecursionError.
        """
        if index not in self._entries:
            if not 0 <= index < len(self._header.entries):
                raise CorruptCheckpointError(f"{self.path}: reference to entry {index}, which does not exist")
            if index in self._restoring:
                raise CorruptCheckpointError(f"{self.path}: entry {index} refers to itself", path=self.path)
            entry = self._header.entries[index]
            provider = get_provider(entry.provider)
            if provider is None:
                raise UnsupportedFormatError(f"{self.path}: entry {entry.name!r} needs provider {entry.provider!r}, not installed")
            try:
                entry = provider.plan(entry, self._sources)
            except InvalidRequestError as exc:
                raise malformed(self.path, entry, exc.message) from None
            self._restoring.add(index)
            try:
                self._entries[index] = provider.restore(entry, self)
            finally:
                self._restoring.discard(index)
        return self._entries[index]

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._device is None or self._device.type == "cpu" else tensor.to(self._device)


def load(path: str | os.PathLike, map_location: MapLocation = None, *, verify: bool = True, weights_only: bool = True) -> Any:
    """The state saved at ``path``, bitwise as it was snapshotted.

    The data region is read in one pass of large parallel reads into one buffer, and
    every storage is a slice of it, as with ``torch.load(mmap=True)``: no per-tensor
    allocation and no second copy. With ``verify`` (the default) every byte is checked
    against its checksum.

    Refuses, with CorruptCheckpointError naming the file and the tensor, a file of the
    wrong size, a truncated one, or one whose header or data checksums do not match.
    By default (``weights_only=True``, as ``torch.load`` since torch 2.6) the skeleton goes
    through torch's safe unpickler, which builds tensors, containers, plain values and the
    objects training states commonly hold (numpy arrays and dtypes, RNG states,
    ``torch.Size``, ``argparse.Namespace``; more with ``torch.serialization.add_safe_globals``),
    and raises WeightsOnlyError for anything else. ``weights_only=False`` unpickles anything,
    which runs code the file's author chose: only for files you trust.
    """
    path = os.fspath(path)
    device = torch.device(map_location) if map_location is not None else None
    header, base, end, layout = read_header(path)
    check_identity(path, header)
    ctx = _Restore(path, _read_data(path, base, end), header, verify, device, weights_only)
    if verify:  # what torch.load would rebuild from the file is what this load rebuilds
        check_views(path, header)
        if layout is not None:
            check_zip(path, header, layout, ctx.region)
    return ctx.entry(header.root)
