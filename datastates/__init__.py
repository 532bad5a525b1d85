"""datastates: a per-node checkpoint daemon for PyTorch training.

The trainer-side API: ``Client`` (in ``datastates.client``), ``load`` and ``latest``.
"""

from datastates.client.reader import latest, load
from datastates.protocol import errors
from datastates.protocol.version import FORMAT_VERSION, PROTOCOL_VERSION

__version__ = "0.1.0"
__all__ = ["FORMAT_VERSION", "PROTOCOL_VERSION", "errors", "latest", "load", "Client"]


def __getattr__(name: str):
    if name == "Client":  # lazy, so `import datastates` stays light for load() users
        from datastates.client import Client

        return Client
    raise AttributeError(name)
