"""datastates: a per-node checkpoint daemon for PyTorch training.

The trainer-side API: ``Client`` (in ``datastates.client``), ``load`` and ``latest``. Each
loads on first use, so ``import datastates`` is light: no torch until ``load`` or
``Client`` is used, and never zmq, yaml or a daemon module for ``load`` and ``latest``.
"""

from typing import Any

from datastates.protocol import errors
from datastates.protocol.version import FORMAT_VERSION, PROTOCOL_VERSION

__version__ = "0.1.0"
__all__ = ["FORMAT_VERSION", "PROTOCOL_VERSION", "errors", "latest", "load", "Client"]


def __getattr__(name: str) -> Any:
    if name == "latest":
        from datastates.client.locate import latest

        return latest
    if name == "load":
        from datastates.client.reader import load

        return load
    if name == "Client":
        from datastates.client import Client

        return Client
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
