"""The tensor provider: a tensor is a view (dtype, shape, stride, offset) of a raw storage, captured and restored.

Storage bytes go to disk exactly as they are in memory, with no re-packing, and views of
one storage share it again after a load, as ``torch.save`` keeps them. Its torch-free half
(the view check, and the opcodes of ``data.pkl``) is protocol/tensormeta.py, for ``verify``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from datastates.protocol.descriptors import EntryDesc, SourceDesc
from datastates.protocol.errors import InvalidRequestError
from datastates.protocol.tensormeta import DTYPE_SIZES, NAME, check_view

from .base import CaptureContext, RestoreContext, StateProvider
from .registry import register_provider

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}
"""Every dtype of the format (``DTYPE_SIZES``) this torch has."""

_DTYPE_NAMES = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}


class _Sizes(Sequence[int]):
    """The sources' sizes as ``check_view`` reads them (how many, and one of them): a list of every size for each
    entry made planning a file or snapshot of n tensors cost n^2 (16 of 70 ms for 447 tensors)."""

    def __init__(self, sources: Sequence[SourceDesc]) -> None:
        self._sources = sources

    def __len__(self) -> int:
        return len(self._sources)

    def __getitem__(self, index: int) -> int:  # type: ignore[override]  # check_view reads one item, never a slice
        return self._sources[index].nbytes


_FLAGS = ("requires_grad", "parameter")


class TensorProvider(StateProvider):
    """Dense CPU and CUDA tensors and Parameters: shared storage plus dtype, shape, stride and offset."""

    name = NAME
    types = (torch.Tensor,)

    def capture(self, obj: torch.Tensor, name: str, ctx: CaptureContext) -> EntryDesc | None:
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            return None  # subclasses carry state of their own: let pickle keep it
        cuda = obj.is_cuda
        if (not (cuda or obj.is_cpu) or obj.layout != torch.strided or obj.is_quantized
                or obj.is_nested):  # nested tensors have no single strided storage: pickled as torch.save does
            return None
        t = obj
        if t.is_conj() or t.is_neg():
            t = t.detach().resolve_conj().resolve_neg()
            ctx.keepalive.append(t)
        return EntryDesc(
            provider=self.name,
            name=name,
            meta={
                "storage": ctx.add_storage(t.untyped_storage(), cuda),
                "dtype": _DTYPE_NAMES[t.dtype],
                "shape": list(t.shape),
                "stride": list(t.stride()),
                "storage_offset": t.storage_offset(),
                "requires_grad": obj.requires_grad,
                "parameter": type(obj) is torch.nn.Parameter,  # its metaclass's isinstance: 3 us a tensor
            },
        )

    def plan(self, entry: EntryDesc, sources: Sequence[SourceDesc]) -> EntryDesc:
        meta = check_view(entry.name, entry.meta, _Sizes(sources))
        if meta["dtype"] not in DTYPES:
            raise InvalidRequestError(f"tensor {entry.name!r}: dtype {meta['dtype']!r} is not one this torch has")
        if list(meta) == list(entry.meta) and all(meta[k] is entry.meta[k] for k in _FLAGS) and meta == entry.meta:
            return entry  # as the client sends it (flags the very bools): kept, not made again
        return EntryDesc(provider=self.name, name=entry.name, meta=meta)

    def restore(self, entry: EntryDesc, ctx: RestoreContext) -> torch.Tensor:
        meta = entry.meta
        dtype = DTYPES[meta["dtype"]]
        storage = ctx.storage(meta["storage"])  # a meta storage where ``load(into=...)`` plans before reading
        t = torch.empty(0, dtype=dtype, device=storage.device).set_(storage, meta["storage_offset"], meta["shape"],
                                                                    meta["stride"])
        t = ctx.place(t)
        if meta["parameter"]:
            return torch.nn.Parameter(t, requires_grad=meta["requires_grad"])
        return t.requires_grad_(meta["requires_grad"])


register_provider(TensorProvider())
