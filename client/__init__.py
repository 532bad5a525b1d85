"""What runs in the training rank: the client, state capture, and the reader.

``Client`` and its companions load on first use, so ``import datastates`` (for ``load``
and ``latest``) pulls in neither zmq nor the connection machinery.
"""

from typing import Any

__all__ = ["Client", "Restored", "SnapshotHandle", "daemon_status"]


def __getattr__(name: str) -> Any:
    if name == "daemon_status":  # no torch: datastatesctl and job scripts only ask the daemon
        from .connection import daemon_status

        return daemon_status
    if name in __all__:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
