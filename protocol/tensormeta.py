"""The tensor provider's torch-free half: the dtypes the format holds, the view a tensor is, and its data.pkl opcodes.

A tensor entry is one leaf kind (protocol/providers/tensor.py captures and restores it with torch); what needs no
torch lives here, outside that package (whose import registers the built-in providers, and so imports torch), for
``verify`` and the daemon to use without it. The daemon checks a SNAPSHOT's tensor entries with ``check_view`` at
admission, ``datastates.load`` checks a file's again before rebuilding them, and ``verify`` (no torch) checks them the
same way, so a view ``datastates.load`` refuses is never one ``verify`` passes. ``pickled_tensor`` is what
``torch.save`` writes into ``data.pkl`` for one tensor entry: the zip writer (protocol/torchzip.py) splices it in
place of the entry's persistent id, and ``verify`` rebuilds it to compare.
"""

from __future__ import annotations

import functools
import math
import struct
from typing import Any, Sequence

from .errors import InvalidRequestError

NAME = "tensor"
"""The tensor provider's type string, stored in each tensor entry of a file."""
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


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t" if items else b")"


_NO_HOOKS = b"ccollections\nOrderedDict\n)R"
TYPED_STORAGES: dict[str, str] = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "int64": "LongStorage",
    "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage",
    "bool": "BoolStorage", "bfloat16": "BFloat16Storage", "complex128": "ComplexDoubleStorage",
    "complex64": "ComplexFloatStorage",
}
"""The dense dtypes ``torch.save`` names a typed storage for (torch's legacy ``_dtype_to_storage_type_map``, which no
longer grows). Part of the format, not asked of torch: ``verify`` rebuilds ``data.pkl`` without torch, and a file's
bytes do not depend on the torch that wrote it. tests/test_dtypes.py pins it to torch's."""


def _tensor(meta: dict, nbytes: int, requires_grad: bool, typed: bool) -> bytes:
    """torch.save's pickle of one tensor (of a storage of ``nbytes``): ``_rebuild_tensor_v2`` of a typed storage
    record where its storage is viewed as that one dtype (torch.load caches a storage by record, typed as it first
    meets it), else ``_rebuild_tensor_v3`` of an untyped one, which takes any dtype, as torch.save does for the
    newer ones."""
    opening, kind, itemsize, closing = _tensor_parts(meta["dtype"], typed)
    storage = kind + _str(str(meta["storage"])) + _CPU + _int(nbytes // itemsize) + b"tQ"
    return (opening + storage + _int(meta["storage_offset"]) + _tuple([_int(n) for n in meta["shape"]])
            + _tuple([_int(n) for n in meta["stride"]]) + (b"\x88" if requires_grad else b"\x89") + _NO_HOOKS
            + closing)


_CPU = _str("cpu")


@functools.cache
def _tensor_parts(dtype: str, typed: bool) -> tuple[bytes, bytes, int, bytes]:
    """The bytes of ``_tensor`` that depend on the dtype alone: before the storage tuple's key (the rebuild call,
    the tuple's mark, "storage" and the storage type), the item size it counts in, and after the view."""
    if typed:
        kind, itemsize = f"ctorch\n{TYPED_STORAGES[dtype]}\n", DTYPE_SIZES[dtype]
        return (b"ctorch._utils\n_rebuild_tensor_v2\n(", b"(" + _str("storage") + kind.encode(), itemsize, b"tR")
    return (b"ctorch._utils\n_rebuild_tensor_v3\n(", b"(" + _str("storage") + b"ctorch.storage\nUntypedStorage\n", 1,
            f"ctorch\n{dtype}\n".encode() + b"tR")


def typed_storages(tensors: dict[int, dict], storage_sizes: Sequence[int]) -> set[int]:
    """The storages every tensor (``tensors``: each tensor entry's meta, by index) views as one dtype that has a
    typed storage, of a whole number of items: those ``pickled_tensor`` names as typed."""
    dtypes: dict[int, str] = {}
    mixed: set[int] = set()
    for meta in tensors.values():
        if dtypes.setdefault(meta["storage"], meta["dtype"]) != meta["dtype"]:
            mixed.add(meta["storage"])
    return {k for k, dt in dtypes.items()
            if k not in mixed and dt in TYPED_STORAGES and storage_sizes[k] % DTYPE_SIZES[dt] == 0}


def pickled_tensor(meta: dict, nbytes: int, typed: bool) -> bytes:
    """torch.save's pickle of the tensor (or Parameter) whose checked meta is ``meta``, of a storage of ``nbytes``
    bytes, ``typed`` if its storage is among ``typed_storages``."""
    if meta["parameter"]:
        return (b"ctorch._utils\n_rebuild_parameter\n(" + _tensor(meta, nbytes, False, typed)
                + (b"\x88" if meta["requires_grad"] else b"\x89") + _NO_HOOKS + b"tR")
    return _tensor(meta, nbytes, meta["requires_grad"], typed)
