"""The copy engine's inner step, run on a copy thread: one piece into one pool chunk.

Host regions copy with torch's ``copy_``, a memcpy that releases the GIL, so copy threads
run in parallel; device regions queue theirs on the thread's own CUDA stream, and the
thread waits for them all at once. Every copy queued is waited for before this returns or
raises, so a chunk goes back to the pool only once no device copy can still land in it
(the next snapshot's bytes would be overwritten). The bytes between storages are zeroed,
then the piece's fills (the zip local headers before storages) written into them, so a
reused chunk never leaks an older snapshot into a new file.

Each segment is checksummed on the daemon's own copy, the bytes written (``write_hashed``), on
the flush side: the trainer's ``wait()`` waits for the copy alone, not for the hash too.
"""

from __future__ import annotations

from typing import Callable, Sequence

from datastates.protocol.format import checksum
from datastates.protocol.layout import Piece

from .memory import Chunk, Window
from .sink import FileSink
from .sources import Pending, Region


SMALL_READ = 256 << 10
"""Segments up to this size are read in batches (``Region.read_batch``), where their region allows it: per tensor,
a call costs more than its bytes."""


def copy_piece(piece: Piece, chunk: Chunk | Window, regions: Sequence[Region],
               before: Callable[[Region], None] = lambda region: None,
               progress: Callable[[int], None] = lambda nbytes: None) -> None:
    """Fill ``chunk`` with ``piece``.

    ``before(region)`` runs before each segment is read (each batch of small ones), and raises to stop the piece
    (its trainer went, and its memory with it). ``progress(nbytes)`` is told the bytes of each
    segment once they are in ``chunk``: a host copy's as it returns, device copies' once waited for.
    """
    dst = chunk.tensor
    cursor = 0
    pending: list[Pending] = []
    in_flight = 0
    batch: list[tuple[Region, int, int, int]] = []
    batch_from = 0

    def read_batch() -> None:
        """The small reads gathered, at once: their span zeroed first (the gaps between them), then read."""
        dst[batch_from:cursor].zero_()
        type(batch[0][0]).read_batch(batch)
        progress(sum(length for _, _, _, length in batch))
        batch.clear()

    try:
        for seg in piece.segments:
            region = regions[seg.source]
            key = region.batch_key() if seg.length <= SMALL_READ else None
            if batch and (key is None or key != batch[0][0].batch_key()):
                read_batch()
            if key is not None:
                if not batch:
                    before(region)
                    batch_from = cursor
                if seg.dst + seg.length > dst.numel():
                    raise ValueError(f"a {seg.length}-byte segment at {seg.dst} overruns a {dst.numel()}-byte chunk")
                batch.append((region, dst.data_ptr() + seg.dst, seg.src, seg.length))
                cursor = seg.dst + seg.length
                continue
            if seg.dst > cursor:
                dst[cursor:seg.dst].zero_()
            before(region)
            copy = region.read_into(dst[seg.dst:seg.dst + seg.length], seg.src, seg.length)
            if copy is not None:
                pending.append(copy)
                in_flight += seg.length
            else:
                progress(seg.length)
            cursor = seg.dst + seg.length
        if batch:
            read_batch()
        if cursor < piece.length:
            dst[cursor:piece.length].zero_()
        for at, data in piece.fills:
            chunk.view[at:at + len(data)] = data
    finally:
        _wait_all(pending)
    if in_flight:
        progress(in_flight)


def write_hashed(sink: FileSink, piece: Piece, chunk: Chunk | Window, at: int, from_replica: bool,
                 sums: list[list[bytes]], replicas: bool = True) -> None:
    """On the flush side: ``piece``'s ``checksums`` into ``sums`` (by storage and slot), then its bytes in ``chunk``
    to the file at ``at`` (and to the replicas, unless ``replicas`` is False: ``FileSink.write``)."""
    for storage, slot, digest in checksums(piece, chunk):
        sums[storage][slot] = digest
    sink.write(at, chunk.view[: piece.length], from_replica, replicas)


def checksums(piece: Piece, chunk: Chunk | Window) -> list[tuple[int, int, bytes]]:
    """(storage, slot, checksum) of each segment of ``piece``, as ``copy_piece`` left it in ``chunk``."""
    return [(seg.source, seg.slot, checksum(chunk.view[seg.dst:seg.dst + seg.length])) for seg in piece.segments]


def _wait_all(pending: list[Pending]) -> None:
    """Wait for every copy, even after one of them failed; then raise the first failure."""
    failure: BaseException | None = None
    for copy in pending:
        try:
            copy.synchronize()
        except BaseException as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
