"""Rebuilding a checkpoint file's entries through their providers: what a fresh and an in-place load share."""

from __future__ import annotations

from typing import Any

import torch

from datastates.protocol.descriptors import EMPTY, EntryDesc, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, UnsupportedFormatError
from datastates.protocol.format import FileHeader
from datastates.protocol.providers import get_provider
from datastates.protocol.providers.base import StateProvider

from .filecheck import malformed


class Entries:
    """A file's entries rebuilt by index through their providers, each once: the RestoreContext's ``entry``.

    Subclasses say where a storage's bytes are (``storage``) and where a tensor goes (``place``).
    """

    def __init__(self, path: str, header: FileHeader, weights_only: bool) -> None:
        self.path = path
        self.weights_only = weights_only
        self.header = header
        self._entries: dict[int, Any] = {}
        self._restoring: set[int] = set()
        self._sources = [SourceDesc(kind=EMPTY, handle="", nbytes=rec.nbytes) for rec in header.storages]
        """The storages as a provider's ``plan`` sees a snapshot's sources: only their sizes matter to it."""

    def storage(self, index: int) -> torch.UntypedStorage:
        raise NotImplementedError

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

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
                self._entries[index] = self.build(index, self.planned(index))
            finally:
                self._restoring.discard(index)
        return self._entries[index]

    def planned(self, index: int) -> EntryDesc:
        """Entry ``index`` as its provider checked it."""
        entry = self.header.entries[index]
        try:
            return provider_of(self.path, entry).plan(entry, self._sources)
        except InvalidRequestError as exc:
            raise malformed(self.path, entry, exc.message) from None

    def build(self, index: int, entry: EntryDesc) -> Any:
        """The object of entry ``index`` (checked: ``planned``); a subclass may hand back another one."""
        return provider_of(self.path, entry).restore(entry, self)


def provider_of(path: str, entry: EntryDesc) -> StateProvider:
    provider = get_provider(entry.provider)
    if provider is None:
        raise UnsupportedFormatError(f"{path}: entry {entry.name!r} needs provider {entry.provider!r}, not installed")
    return provider
