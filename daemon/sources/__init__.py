"""Copy sources by kind; importing this package registers the built-in ones."""

from . import cuda as _cuda  # noqa: F401  (registers cuda_ipc; touches no CUDA until a region opens)
from . import shm as _shm  # noqa: F401  (registers shm and empty)
from . import vm as _vm  # noqa: F401  (registers vm)
from .base import CopySource, Owner, Pending, Region, open_region, register_source

__all__ = ["CopySource", "Owner", "Pending", "Region", "open_region", "register_source"]
