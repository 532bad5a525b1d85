"""Copy sources by kind; importing this package registers the built-in ones."""

from . import cuda as _cuda  # noqa: F401  (registers cuda_ipc; touches no CUDA until a region opens)
from . import shm as _shm  # noqa: F401  (registers shm and empty)
from .base import CopySource, Pending, Region, open_region, register_source

__all__ = ["CopySource", "Pending", "Region", "open_region", "register_source"]
