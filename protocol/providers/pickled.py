"""The object provider: everything that is not a registered leaf, pickled in the client.

Its payload is the state's skeleton, with each captured leaf replaced by a persistent id
(the index of that leaf's entry), so nesting, shared references and arbitrary Python
objects survive exactly as pickle keeps them. With ``weights_only`` the skeleton goes
through torch's safe unpickler, which accepts only tensors, containers and primitives.
"""

from __future__ import annotations

import enum
import functools
import io
import pickle
import pickletools
import struct
import sys
from typing import Any, Sequence

import torch
from torch import _weights_only_unpickler

from datastates.protocol.descriptors import EntryDesc, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, DatastatesError, InvalidRequestError, WeightsOnlyError

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
            with torch.serialization.safe_globals(training_globals() + imported_enums(entry.meta["data"])):
                return safe.load()
        except DatastatesError:
            raise
        except (EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError, RuntimeError, OverflowError,
                MemoryError, RecursionError, struct.error) as exc:  # bytes no pickler wrote: crafted or damaged
            raise CorruptCheckpointError(f"{ctx.path}: the skeleton {entry.name!r} is not a valid pickle: "
                                         f"{type(exc).__name__}: {str(exc)[:200]}", path=ctx.path) from None
        except pickle.UnpicklingError as exc:
            raise WeightsOnlyError(
                f"{ctx.path}: the safe loader (weights_only=True, the default) refuses an object in the skeleton: "
                f"{exc}. Allow its class with torch.serialization.add_safe_globals([...]), or load with "
                "weights_only=False only if you trust the file: unpickling runs code its author chose.",
                path=ctx.path,
            ) from None


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def imported_enums(data: bytes) -> list[type]:
    """The enum classes the pickle ``data`` names whose module this process has already imported.

    Training states hold enums (DeepSpeed's ``ZeroStageEnum``, schedulers' modes). Building
    a member of an enum class already loaded runs no code a file can choose: nothing is
    imported, and the member is looked up by value. Classes of modules not imported yet
    stay refused; allow them with ``torch.serialization.add_safe_globals``.
    """
    names: list[tuple[str, str]] = []
    strings: list[str] = []
    memo: dict[int, Any] = {}
    last: Any = None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in _STRING_OPS:
                last = arg
                strings.append(arg)
            elif op.name == "MEMOIZE":
                memo[len(memo)] = last
            elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[int(arg)] = last
            elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                last = memo.get(int(arg))
                if isinstance(last, str):
                    strings.append(last)
            elif op.name == "GLOBAL":
                names.append(tuple(arg.split(" ", 1)))  # type: ignore[arg-type]
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append((strings[-2], strings[-1]))
            if op.name not in _STRING_OPS and op.name not in ("MEMOIZE", "GET", "BINGET", "LONG_BINGET"):
                last = None
    except Exception:  # noqa: BLE001 - a malformed pickle: the safe unpickler refuses it with its own error
        return []
    found = []
    for module, qualname in set(names):
        obj: Any = sys.modules.get(module)
        for part in qualname.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, type) and issubclass(obj, enum.Enum) and obj.__members__:  # not the bare bases
            found.append(obj)
    return found


@functools.cache
def training_globals() -> list[Any]:
    """What training states commonly hold beyond torch's own safe set: numpy arrays, scalars and dtypes (numpy's
    RNG state is one), and ``argparse.Namespace``. Torch's set already covers tensors, ``torch.Size``, dtypes,
    containers and plain values (Python's RNG state is a tuple of ints). Users extend it with
    ``torch.serialization.add_safe_globals``."""
    import argparse

    allowed: list[Any] = [argparse.Namespace]
    try:
        import numpy as np
    except ImportError:
        return allowed
    multiarray = getattr(np, "_core", None) or np.core
    allowed += [np.ndarray, np.dtype, multiarray.multiarray._reconstruct, multiarray.multiarray.scalar]
    allowed += [type(np.dtype(t)) for t in np.sctypeDict.values()]  # the dtype classes pickles name (numpy >= 1.25)
    allowed += [(multiarray.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
                (multiarray.multiarray.scalar, "numpy.core.multiarray.scalar")]  # as numpy < 2 named them
    return allowed


register_provider(PickleProvider())
