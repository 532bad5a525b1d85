"""The object provider: everything that is not a registered leaf, pickled in the client.

Its payload is the state's skeleton, with each captured leaf replaced by a persistent id
(the index of that leaf's entry), so nesting, shared references and arbitrary Python
objects survive exactly as pickle keeps them. With ``weights_only`` the skeleton goes
through torch's safe unpickler, which accepts only tensors, containers and primitives.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Sequence

from torch import _weights_only_unpickler

from datastates.protocol.descriptors import EntryDesc, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, WeightsOnlyError

from .base import RestoreContext, StateProvider
from .registry import register_provider

def _persistent(ctx: RestoreContext, pid: Any) -> Any:
    """A persistent id is the index of the entry that replaces it in the skeleton."""
    if type(pid) is not int:
        raise CorruptCheckpointError(f"{ctx.path}: unknown persistent id {pid!r} in the skeleton")
    return ctx.entry(pid)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, ctx: RestoreContext) -> None:
        super().__init__(io.BytesIO(data))
        self._ctx = ctx

    def persistent_load(self, pid: Any) -> Any:
        return _persistent(self._ctx, pid)


class PickleProvider(StateProvider):
    name = "pickle"

    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        if not isinstance(entry.meta.get("data"), bytes):
            raise InvalidRequestError(f"object {entry.name!r}: 'data' must be pickled bytes")
        return EntryDesc(provider=self.name, name=entry.name, meta={"data": entry.meta["data"]})

    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> Any:
        if not ctx.weights_only:
            return _Unpickler(entry.meta["data"], ctx).load()
        safe = _weights_only_unpickler.Unpickler(io.BytesIO(entry.meta["data"]), encoding="utf-8")
        safe.persistent_load = lambda pid: _persistent(ctx, pid)
        try:
            return safe.load()
        except pickle.UnpicklingError as exc:
            raise WeightsOnlyError(
                f"{ctx.path}: weights_only=True refuses an object in the skeleton: {exc}. "
                "Load with weights_only=False only if you trust the file.",
                path=ctx.path,
            ) from None


register_provider(PickleProvider())
