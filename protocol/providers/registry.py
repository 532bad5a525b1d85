"""The provider registry, keyed by the type string stored on disk, and by the Python types providers capture."""

from __future__ import annotations

from typing import Any

from .base import StateProvider

_PROVIDERS: dict[str, StateProvider] = {}
_BY_TYPE: dict[type, StateProvider] = {}
_RESOLVED: dict[type, StateProvider | None] = {}

PLAIN = frozenset({str, int, float, bool, type(None), bytes})
"""Types no provider captures (``register_provider`` refuses them), so a capture passes them on at once."""


def register_provider(provider: StateProvider) -> StateProvider:
    """Register ``provider`` under its name and its ``types``; ValueError for a name taken, or a type that is, or is
    a base of, one of PLAIN."""
    if provider.name in _PROVIDERS:
        raise ValueError(f"a provider named {provider.name!r} is registered already")
    for t in provider.types:
        if any(issubclass(plain, t) for plain in PLAIN):
            raise ValueError(f"a provider cannot capture {t.__name__}: str, numbers, bytes and None stay in the "
                             "skeleton")
    _PROVIDERS[provider.name] = provider
    for t in provider.types:
        _BY_TYPE[t] = provider
    _RESOLVED.clear()
    return provider


def provider_for(obj: Any) -> StateProvider | None:
    """The provider that captures ``obj``'s type, through its MRO; one dict lookup once a type is seen."""
    cls = type(obj)
    try:
        return _RESOLVED[cls]
    except KeyError:
        _RESOLVED[cls] = next((_BY_TYPE[t] for t in cls.__mro__ if t in _BY_TYPE), None)
        return _RESOLVED[cls]


def get_provider(name: str) -> StateProvider | None:
    return _PROVIDERS.get(name)


def provider_names() -> list[str]:
    return sorted(_PROVIDERS)
