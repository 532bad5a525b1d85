"""Storage writers by scheme; importing this package registers the built-in ones."""

from . import posix as _posix  # noqa: F401
from . import s3 as _s3  # noqa: F401
from .base import StorageWriter, register_writer, writer_class

__all__ = ["StorageWriter", "register_writer", "writer_class"]
