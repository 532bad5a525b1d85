"""State providers: one class per kind of state, from capture to restore, registered by a stable type string.

Call order and callers:
1. The client's capture (client/capture.py) calls ``capture(obj, name, ctx)`` for each leaf
   of one of a provider's ``types``: the ``EntryDesc`` it returns names this provider.
2. The daemon calls ``plan(entry, sources)`` for every entry of an admitted SNAPSHOT; it
   checks the untrusted ``meta`` and returns the entry as it goes into the file index.
3. ``datastates.load`` calls ``restore(entry, ctx)`` to rebuild the object.

The type string is stored in the file, so a provider's ``name`` never changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, Sequence

import torch

from datastates.protocol.descriptors import EntryDesc, SourceDesc


class CaptureContext(Protocol):
    """What the client's capture offers a provider while describing one snapshot's leaves."""

    keepalive: list[Any]
    """Held until the daemon has copied: what a provider made for the snapshot (a resolved tensor) goes here."""

    def add_storage(self, storage: torch.UntypedStorage, cuda: bool) -> int:
        """The index of ``storage`` among the snapshot's sources (a storage shared by views counts once)."""
        ...


class RestoreContext(Protocol):
    """What the loader offers a provider while rebuilding one file."""

    path: str
    weights_only: bool
    """Restore objects only through torch's safe unpickler (``torch.load(weights_only=True)``)."""

    def storage(self, index: int) -> torch.UntypedStorage: ...

    def entry(self, index: int) -> Any: ...

    def place(self, tensor: torch.Tensor) -> torch.Tensor: ...


class StateProvider(ABC):
    name: ClassVar[str]
    types: ClassVar[tuple[type, ...]] = ()
    """The Python types whose objects it captures as leaves; none for one that only restores what the pickled
    skeleton carries."""

    def capture(self, obj: Any, name: str, ctx: CaptureContext) -> EntryDesc | None:
        """The entry for ``obj`` (of one of ``types``), or None to leave it to the pickled skeleton."""
        return None

    @abstractmethod
    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        """The checked index entry; raises InvalidRequestError for meta that makes no sense. It may depend on
        ``entry`` and the sources' sizes only: the daemon reuses it for the next snapshot of the same state."""

    @abstractmethod
    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> Any:
        """The object ``entry`` describes, built from the file's storages."""
