"""Checked conversion between frozen dataclasses and the plain dicts msgpack carries.

Every message body and descriptor is a frozen dataclass; this module is the only place
that turns untrusted dicts into them, so a malformed peer gets a ProtocolError, never a
KeyError or TypeError deep inside the daemon.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Callable, TypeVar

import msgpack

from .errors import ProtocolError

T = TypeVar("T")

_MAX_DEPTH = 8


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Decoded:
    """A field's value decoded already (protocol/messages.py keeps long ones): ``from_dict`` takes it as built.
    msgpack never makes one, so no peer can send it; not a tuple, so no checker takes it for a list."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@functools.cache
def list_fields(cls: type) -> frozenset[str]:
    """The fields of dataclass ``cls`` that hold a list: the only ones given as ``Decoded``."""
    return frozenset(name for name, hint in _hints(cls).items() if typing.get_origin(hint) is list)


def _check(value: Any, hint: Any, where: str, depth: int = 0) -> Any:
    if type(value) is Decoded:
        return value.value
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"{where}: nested too deeply")
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], where, depth + 1)
    if hint is Any:
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint) or (Any,)
        return [_check(v, item, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        return value
    if dataclasses.is_dataclass(hint):
        return _checked(hint, value, where)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool):
        raise ProtocolError(f"{where}: expected int, got bool")
    if not isinstance(value, hint):
        raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value


def from_dict(cls: type[T], data: Any, where: str | None = None) -> T:
    """Build ``cls`` from an untrusted dict; unknown keys are tolerated, as Jupyter does.

    Checked by a checker made once per class (``_builder``): a thousand-entry header or
    snapshot went through ``_check``'s generic walk in 20-40 ms. What it refuses goes through
    ``_check`` again, which names the first misfit."""
    try:
        return _builder(cls)(data)
    except _Misfit:
        return _checked(cls, data, where)


def _checked(cls: type[T], data: Any, where: str | None = None) -> T:
    """``from_dict`` by the generic walk: ProtocolError naming the first misfit."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _check(data[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{where}: missing field {f.name!r}")
    return cls(**kwargs)


class _Misfit(Exception):
    """A value a checker of ``_builder`` refuses; ``_checked`` then says why."""


def _misfit() -> Any:
    raise _Misfit


@functools.cache
def _builder(cls: type[T]) -> Callable[[Any], T]:
    """``cls`` from a dict, as ``_checked`` builds it, with each field's checker (``_checker``) made once."""
    hints = _hints(cls)
    fields = [(f.name, _checker(hints[f.name], 0), f.default, f.default_factory) for f in dataclasses.fields(cls)]
    missing = dataclasses.MISSING
    direct = cls.__dataclass_params__.init and all(f.init for f in dataclasses.fields(cls)) \
        and not hasattr(cls, "__post_init__") and "__slots__" not in vars(cls)
    """Made without its ``__init__``: a frozen dataclass's sets each field through ``object.__setattr__``, half
    the time of decoding a snapshot of 100,000 tensors. The same fields, in the same order, as ``__init__``
    would set them."""

    def build(data: Any) -> T:
        if not isinstance(data, dict):
            _misfit()
        kwargs = {}
        for name, check, default, factory in fields:
            if name in data:
                kwargs[name] = check(data[name])
            elif default is not missing:
                kwargs[name] = default
            elif factory is not missing:
                kwargs[name] = factory()
            else:
                _misfit()
        if not direct:
            return cls(**kwargs)
        obj = object.__new__(cls)
        obj.__dict__.update(kwargs)
        return obj

    return build


def _checker(hint: Any, depth: int) -> Callable[[Any], Any]:
    """What ``_check(value, hint, ..., depth)`` returns for a value it accepts; raises _Misfit for any other."""
    if depth > _MAX_DEPTH:
        return _misfit
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        inner = _checker([a for a in args if a is not type(None)][0], depth + 1)
        return (lambda v: None if v is None else inner(v)) if type(None) in args else inner
    if hint is Any:
        return lambda v: v
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        each = _checker(item, depth + 1)
        return lambda v: v.value if type(v) is Decoded else \
            [each(x) for x in v] if isinstance(v, (list, tuple)) else _misfit()
    if origin is dict:
        return lambda v: v if isinstance(v, dict) else _misfit()
    if dataclasses.is_dataclass(hint):
        return lambda v: _builder(hint)(v)  # made on first use: a dataclass may hold its own kind
    if hint is float:
        return lambda v: v if isinstance(v, float) else \
            float(v) if isinstance(v, int) and not isinstance(v, bool) else _misfit()
    if hint is int:
        return lambda v: v if isinstance(v, int) and not isinstance(v, bool) else _misfit()
    return lambda v: v if isinstance(v, hint) else _misfit()


_FIELDS: dict[type, tuple[str, ...]] = {}
"""Each dataclass met by ``plain``, and its fields' names in order."""


def plain(obj: Any) -> dict[str, Any]:
    """One dataclass as a shallow dict: the ``default`` hook of msgpack and json encoders.

    The encoder recurses in C and calls this only for dataclasses, so nothing is deep
    copied: ``dataclasses.asdict`` on a thousand-tensor snapshot cost more than capturing it.
    Where the instance's ``__dict__`` holds exactly its fields (a dataclass's ``__init__`` sets
    them in field order) it is that dict itself, read and not kept by the encoder: 100,000
    tensors' entries and sources encode in a third of the time.
    """
    names = _FIELDS.get(type(obj))
    if names is None:
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"cannot encode {type(obj).__name__}")
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    state = getattr(obj, "__dict__", None)
    if state is not None and len(state) == len(names):
        return state
    return {name: getattr(obj, name) for name in names}


def pack(obj: Any, packed: dict[str, bytes] | None = None) -> bytes:
    """msgpack of a dataclass tree. ``packed``: some of ``obj``'s fields packed already (``pack(value)``), as the
    same bytes: msgpack writes a map as its header, then each key and value in turn."""
    if not packed:
        return msgpack.packb(obj, default=plain, use_bin_type=True)
    fields = plain(obj)
    packer = msgpack.Packer(default=plain, use_bin_type=True)
    return packer.pack_map_header(len(fields)) + b"".join(
        packer.pack(k) + (packed[k] if k in packed else packer.pack(v)) for k, v in fields.items())
