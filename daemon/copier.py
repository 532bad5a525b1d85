"""The copy engine's inner step, run on a copy thread: one piece into one pool chunk.

torch's ``copy_`` is a memcpy that releases the GIL, so copy threads run in parallel. The
bytes between storages are zeroed, so a reused chunk never leaks an older snapshot into a
new file, and each segment is checksummed on the daemon's own copy, the bytes written.
"""

from __future__ import annotations

from typing import Sequence

from datastates.protocol.format import checksum

from .memory import Chunk
from .plan import Piece
from .sources import Region


def copy_piece(piece: Piece, chunk: Chunk, regions: Sequence[Region]) -> list[tuple[int, int, bytes]]:
    """Fill ``chunk`` with ``piece``; returns (storage, slot, checksum) for each segment."""
    dst = chunk.tensor
    sums = []
    cursor = 0
    for seg in piece.segments:
        if seg.dst > cursor:
            dst[cursor:seg.dst].zero_()
        dst[seg.dst:seg.dst + seg.length].copy_(regions[seg.source].tensor[seg.src:seg.src + seg.length])
        sums.append((seg.source, seg.slot, checksum(chunk.view[seg.dst:seg.dst + seg.length])))
        cursor = seg.dst + seg.length
    if cursor < piece.length:
        dst[cursor:piece.length].zero_()
    return sums
