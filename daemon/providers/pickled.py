"""The object provider: everything that is not a registered leaf, pickled in the client.

Its payload is the state's skeleton, with each captured leaf replaced by a persistent id
(the index of that leaf's entry), so nesting, shared references and arbitrary Python
objects survive exactly as pickle keeps them.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Sequence

from datastates.protocol.descriptors import EntryDesc, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError
from datastates.protocol.format import PERSISTENT_TAG

from .base import RestoreContext, StateProvider
from .registry import register_provider

class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, ctx: RestoreContext) -> None:
        super().__init__(io.BytesIO(data))
        self._ctx = ctx

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 2 and pid[0] == PERSISTENT_TAG and isinstance(pid[1], int)):
            raise CorruptCheckpointError(f"{self._ctx.path}: unknown persistent id {pid!r} in the skeleton")
        return self._ctx.entry(pid[1])


class PickleProvider(StateProvider):
    name = "pickle"

    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        if not isinstance(entry.meta.get("data"), bytes):
            raise InvalidRequestError(f"object {entry.name!r}: 'data' must be pickled bytes")
        return EntryDesc(provider=self.name, name=entry.name, meta={"data": entry.meta["data"]})

    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> Any:
        return _Unpickler(entry.meta["data"], ctx).load()


register_provider(PickleProvider())
