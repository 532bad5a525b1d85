"""State providers; importing this package registers the built-in ones."""

from . import pickled as _pickled  # noqa: F401
from . import tensor as _tensor  # noqa: F401
from .base import RestoreContext, StateProvider
from .registry import get_provider, provider_names, register_provider

__all__ = ["RestoreContext", "StateProvider", "get_provider", "provider_names", "register_provider"]
