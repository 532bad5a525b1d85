"""State providers; importing this package registers the built-in ones."""

from . import pickled as _pickled  # noqa: F401
from . import tensor as _tensor  # noqa: F401
from .base import CaptureContext, RestoreContext, StateProvider
from .registry import PLAIN, get_provider, provider_for, provider_names, register_provider

__all__ = ["PLAIN", "CaptureContext", "RestoreContext", "StateProvider", "get_provider", "provider_for",
           "provider_names", "register_provider"]
