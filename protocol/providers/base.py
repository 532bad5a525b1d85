"""State providers: one small class per kind of state, registered by a stable type string.

Call order and callers:
1. The client's capturer (client/capture.py) describes a leaf as an ``EntryDesc`` whose
   ``provider`` names a registered provider.
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

    @abstractmethod
    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        """The checked index entry; raises InvalidRequestError for meta that makes no sense. It may depend on
        ``entry`` and the sources' sizes only: the daemon reuses it for the next snapshot of the same state."""

    @abstractmethod
    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> Any:
        """The object ``entry`` describes, built from the file's storages."""
