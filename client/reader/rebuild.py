"""Rebuilding a checkpoint file's entries through their providers, once each: the reader's last step.

Where a storage's bytes are is the caller's: a slice of the data region read whole (a fresh
load), a fresh buffer per storage read into later (a load into ``into``), or a meta storage
(a plan that reads no data: ``load_slices``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from datastates.protocol.descriptors import EMPTY, EntryDesc, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, UnsupportedFormatError
from datastates.protocol.providers import get_provider
from datastates.protocol.providers.base import StateProvider
from datastates.protocol.tensormeta import NAME as TENSOR

from .checks import CheckpointFile, check_bounds, malformed


class Rebuild:
    """A file's entries rebuilt by index through their providers, each once: the RestoreContext a provider sees.

    ``storage`` makes storage ``index`` of ``nbytes`` bytes (asked once per storage, after its bounds are checked);
    ``place`` puts a rebuilt tensor where it goes (a device).
    """

    def __init__(self, file: CheckpointFile, weights_only: bool, storage: Callable[[int, int], torch.UntypedStorage],
                 place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
        self.path = file.path
        self.header = file.header
        self.weights_only = weights_only
        self._region_len = file.end - file.base
        self._make_storage = storage
        self.place = place
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._entries: dict[int, Any] = {}
        self._restoring: set[int] = set()
        self._sources = [SourceDesc(kind=EMPTY, handle="", nbytes=rec.nbytes) for rec in file.header.storages]
        """The storages as a provider's ``plan`` sees a snapshot's sources: only their sizes matter to it."""
        self.tensor_entries: dict[int, int] = {}
        """id() of each rebuilt tensor entry's tensor → its entry's index."""

    def storage(self, index: int) -> torch.UntypedStorage:
        if index not in self._storages:
            check_bounds(self.path, self.header, index, self._region_len)
            self._storages[index] = self._make_storage(index, self.header.storages[index].nbytes)
        return self._storages[index]

    def entry(self, index: int) -> Any:
        """Entry ``index``, restored once, after its provider checked it as the daemon does at admission.

        A file is as untrusted as a client: a tensor's view beyond its storage, an unknown
        dtype or a skeleton that refers to itself is refused with CorruptCheckpointError
        naming the entry, never met as a torch error or a RecursionError.
        """
        if index not in self._entries:
            if not 0 <= index < len(self.header.entries):
                raise CorruptCheckpointError(f"{self.path}: reference to entry {index}, which does not exist")
            if index in self._restoring:
                raise CorruptCheckpointError(f"{self.path}: entry {index} refers to itself", path=self.path)
            self._restoring.add(index)
            try:
                entry = self._planned(index)
                obj = self._entries[index] = _provider(self.path, entry).restore(entry, self)
                if entry.provider == TENSOR:
                    self.tensor_entries[id(obj)] = index
            finally:
                self._restoring.discard(index)
        return self._entries[index]

    def _planned(self, index: int) -> EntryDesc:
        """Entry ``index`` as its provider checked it."""
        entry = self.header.entries[index]
        try:
            return _provider(self.path, entry).plan(entry, self._sources)
        except InvalidRequestError as exc:
            raise malformed(self.path, entry, exc.message) from None


def _provider(path: str, entry: EntryDesc) -> StateProvider:
    provider = get_provider(entry.provider)
    if provider is None:
        raise UnsupportedFormatError(f"{path}: entry {entry.name!r} needs provider {entry.provider!r}, not installed")
    return provider
