"""Storage backends chosen by URL scheme: the one interface both sides write and read checkpoint files through."""

from .base import (Gone, RangeReader, Storage, UploadedStorage, WritableStorage, backend_class, backend_for,
                   register_backend, storage_error)

__all__ = ["Gone", "RangeReader", "Storage", "UploadedStorage", "WritableStorage", "backend_class", "backend_for",
           "register_backend", "storage_error"]
