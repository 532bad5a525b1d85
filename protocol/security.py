"""Who may talk to a daemon: ipc sockets in a private folder, or tcp with CURVE keys."""

from __future__ import annotations

import zmq

from .errors import ConfigError


def secure_client(sock: zmq.Socket, endpoint: str) -> None:
    """Set up ``sock`` to authenticate to the daemon at ``endpoint`` before it connects."""
    if endpoint.startswith("tcp://"):
        raise ConfigError(f"{endpoint}: tcp endpoints are not supported yet")
