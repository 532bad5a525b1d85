"""What runs in the training rank: the client, state capture, and the reader."""

from .client import Client, Restored, SnapshotHandle, daemon_status

__all__ = ["Client", "Restored", "SnapshotHandle", "daemon_status"]
