"""Copy sources by kind; importing this package registers the built-in ones."""

from . import shm as _shm  # noqa: F401  (registers shm and empty)
from .base import CopySource, Region, open_region, register_source

__all__ = ["CopySource", "Region", "open_region", "register_source"]
