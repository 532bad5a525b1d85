"""The tensor provider: a tensor is a view (dtype, shape, stride, offset) of a raw storage.

Storage bytes go to disk exactly as they are in memory, with no re-packing, and views of
one storage share it again after a load, as ``torch.save`` keeps them.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from datastates.protocol.descriptors import EntryDesc, SourceDesc
from datastates.protocol.errors import InvalidRequestError

from .base import RestoreContext, StateProvider
from .registry import register_provider

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d not in _QUANTIZED
}
"""Every dense dtype this torch has, by the name the wire and the file use."""


def _ints(value: Any, what: str, minimum: int) -> list[int]:
    if not isinstance(value, list) or len(value) > 64:
        raise InvalidRequestError(f"{what} must be a list of at most 64 integers")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value):
        raise InvalidRequestError(f"{what} must hold integers >= {minimum}, got {value[:8]}")
    return value


class TensorProvider(StateProvider):
    name = "tensor"

    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        meta = entry.meta
        where = f"tensor {entry.name!r}"
        dtype = DTYPES.get(meta.get("dtype"))  # type: ignore[arg-type]
        if dtype is None:
            raise InvalidRequestError(f"{where}: unknown dtype {str(meta.get('dtype'))[:40]!r}")
        storage = meta.get("storage")
        if not isinstance(storage, int) or isinstance(storage, bool) or not 0 <= storage < len(sources):
            raise InvalidRequestError(f"{where}: storage index {storage!r} is not one of the {len(sources)} sources")
        shape = _ints(meta.get("shape"), f"{where}: shape", 0)
        stride = _ints(meta.get("stride"), f"{where}: stride", 0)
        offset = meta.get("storage_offset")
        if len(shape) != len(stride) or not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidRequestError(f"{where}: shape, stride and storage_offset do not describe a view")
        if math.prod(shape) > 0:
            extent = (offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * dtype.itemsize
            if extent > sources[storage].nbytes:
                raise InvalidRequestError(
                    f"{where}: the view needs {extent} bytes but its storage has {sources[storage].nbytes}"
                )
        flags = {k: bool(meta.get(k, False)) for k in ("requires_grad", "parameter")}
        return EntryDesc(
            provider=self.name,
            name=entry.name,
            meta={"storage": storage, "dtype": meta["dtype"], "shape": shape, "stride": stride,
                  "storage_offset": offset, **flags},
        )

    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> torch.Tensor:
        meta = entry.meta
        dtype = DTYPES[meta["dtype"]]
        t = torch.empty(0, dtype=dtype).set_(ctx.storage(meta["storage"]), meta["storage_offset"], meta["shape"], meta["stride"])
        t = ctx.place(t)
        if meta["parameter"]:
            return torch.nn.Parameter(t, requires_grad=meta["requires_grad"])
        return t.requires_grad_(meta["requires_grad"])


register_provider(TensorProvider())
