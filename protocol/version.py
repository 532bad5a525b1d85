"""The one place that defines the versions of the wire protocol and of the file format."""

PROTOCOL_VERSION = 4
"""Bumped on any incompatible change to a message; a daemon refuses every other version."""

FORMAT_VERSION = 2
"""Bumped on any incompatible change to the checkpoint file layout. 2: a zip ``torch.load`` reads (issue 17)."""
READABLE_FORMATS = (1, 2)
"""The versions ``datastates.load`` reads; it refuses any other."""

COMMIT_VERSION = 1
"""Version of the commit-marker JSON."""
