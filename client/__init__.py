"""What runs in the training rank: the client, state capture, and the reader."""

from .client import Client, SnapshotHandle, daemon_status

__all__ = ["Client", "SnapshotHandle", "daemon_status"]
