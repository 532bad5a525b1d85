"""The one place that defines the versions of the wire protocol and of the file format."""

PROTOCOL_VERSION = 5
"""Bumped on any incompatible change to a message, or to the file format the daemon writes (5: format 3, which an
older client cannot read back); a daemon refuses every other version."""

FORMAT_VERSION = 3
"""Bumped on any incompatible change to the checkpoint file layout. 2: a zip ``torch.load`` reads.
3: large storages start where torch's large CPU tensors start in memory, 64 bytes past a page (format.DIRECT_PHASE),
for in-place loads with O_DIRECT."""
READABLE_FORMATS = (1, 2, 3)
"""The versions ``datastates.load`` reads; it refuses any other."""

COMMIT_VERSION = 1
"""Version of the commit-marker JSON."""
