"""A tensor entry's meta, checked without torch: the dtypes the format holds and the view a tensor is.

The daemon checks a SNAPSHOT's tensor entries with ``check_view`` at admission, ``datastates.load``
checks a file's again before rebuilding them, and ``verify`` (no torch) checks them the same way,
so a view ``datastates.load`` refuses is never one ``verify`` passes.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .errors import InvalidRequestError

DTYPE_SIZES: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2fnuz": 1, "float8_e4m3fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1, "bits16": 2,
    **{f"uint{n}": 1 for n in range(1, 8)}, **{f"int{n}": 1 for n in range(1, 8)},
}
"""Every dense dtype a file can hold, by the name the wire and the file use (torch's without ``torch.``), with its
size in bytes. Part of the format: quantized dtypes are not in it. tests/test_dtypes.py pins it to torch's."""
MAX_VIEW_BYTES = 1 << 57
"""128 PiB, past the largest virtual address space (x86-64's 57-bit): a view whose elements would take more, even a
stride-0 one of a few bytes of storage, was never a real tensor; its element count was crafted."""
_INT64 = 1 << 63
_MAX_DIMS = 64


def _ints(value: Any, what: str, minimum: int) -> list[int]:
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise InvalidRequestError(f"{what} must be a list of at most {_MAX_DIMS} integers")
    if value and not (set(map(type, value)) == {int} and minimum <= min(value) and max(value) < _INT64):
        raise InvalidRequestError(f"{what} must hold integers from {minimum} to 2^63-1, got {value[:8]}")
    return value


def check_view(name: str, meta: dict[str, Any], storage_sizes: Sequence[int]) -> dict[str, Any]:
    """``meta`` of tensor entry ``name`` as it goes into the index; raises InvalidRequestError naming what is wrong.

    A view (dtype, shape, stride, storage offset) of one of the storages, whose sizes are ``storage_sizes``: its
    elements must lie inside that storage, and all of them together must fit MAX_VIEW_BYTES.
    """
    where = f"tensor {name!r}"
    dtype = meta.get("dtype")
    itemsize = DTYPE_SIZES.get(dtype) if isinstance(dtype, str) else None
    if itemsize is None:
        raise InvalidRequestError(f"{where}: unknown dtype {str(dtype)[:40]!r}")
    storage = meta.get("storage")
    if not isinstance(storage, int) or isinstance(storage, bool) or not 0 <= storage < len(storage_sizes):
        raise InvalidRequestError(f"{where}: storage index {storage!r} is not one of the {len(storage_sizes)} sources")
    shape = _ints(meta.get("shape"), f"{where}: shape", 0)
    stride = _ints(meta.get("stride"), f"{where}: stride", 0)
    offset = meta.get("storage_offset")
    if len(shape) != len(stride) or not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < _INT64:
        raise InvalidRequestError(f"{where}: shape, stride and storage_offset do not describe a view")
    numel = math.prod(shape)
    if numel * itemsize > MAX_VIEW_BYTES:
        raise InvalidRequestError(f"{where}: shape {shape[:8]} has {numel} elements of {dtype}, more than "
                                  f"{MAX_VIEW_BYTES} bytes: no real tensor has that many")
    if numel > 0:
        extent = (offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * itemsize
        if extent > storage_sizes[storage]:
            raise InvalidRequestError(f"{where}: the view needs {extent} bytes but its storage has "
                                      f"{storage_sizes[storage]}")
    flags = {k: bool(meta.get(k, False)) for k in ("requires_grad", "parameter")}
    return {"storage": storage, "dtype": dtype, "shape": shape, "stride": stride, "storage_offset": offset, **flags}
