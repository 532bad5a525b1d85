"""The provider registry, keyed by the type string stored on disk."""

from __future__ import annotations

from .base import StateProvider

_PROVIDERS: dict[str, StateProvider] = {}


def register_provider(provider: StateProvider) -> StateProvider:
    if provider.name in _PROVIDERS:
        raise ValueError(f"a provider named {provider.name!r} is registered already")
    _PROVIDERS[provider.name] = provider
    return provider


def get_provider(name: str) -> StateProvider | None:
    return _PROVIDERS.get(name)


def provider_names() -> list[str]:
    return sorted(_PROVIDERS)
