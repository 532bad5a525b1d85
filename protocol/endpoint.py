"""Where a client finds its node's daemon when nobody says otherwise."""

from __future__ import annotations

import os
import tempfile

ENDPOINT_ENV = "DATASTATES_ENDPOINT"


def runtime_dir() -> str:
    """A per-user folder for the daemon's socket: $XDG_RUNTIME_DIR, else the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "datastates")
    return os.path.join(tempfile.gettempdir(), f"datastates-{os.getuid()}")


def default_endpoint() -> str:
    return "ipc://" + os.path.join(runtime_dir(), "datastatesd.sock")


def resolve_endpoint(explicit: str | None = None) -> str:
    """An explicit endpoint, else $DATASTATES_ENDPOINT, else the default node config's."""
    return explicit or os.environ.get(ENDPOINT_ENV) or default_endpoint()
