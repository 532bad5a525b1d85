"""A piece that fails halfway never lets an asynchronous copy land in a chunk the pool has taken back.

A GPU region queues its copy on the daemon's stream and returns; the bytes land later. If a
later segment of the same piece fails and the copy thread returns at once, the engine gives
the chunk back to the pool while those copies are in flight, and they land in whatever
snapshot takes the chunk next. These regions are real plug-ins (``Region`` is the copy
sources' ABC): one whose copies land only when waited for, as a device copy does, and one
that fails.
"""

from __future__ import annotations

import pytest
import torch

from datastates.daemon.copier import checksums, copy_piece
from datastates.daemon.memory import Chunk
from datastates.daemon.sources import Region
from datastates.protocol.layout import Piece, Segment

SEG = 4096


class LateCopy:
    """A copy in flight: its bytes reach the destination only when it is waited for."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src, self.landed = dst, src, False

    def synchronize(self) -> None:
        self.dst.copy_(self.src)
        self.landed = True


class DeviceLike(Region):
    """Copies that complete asynchronously, as a CUDA region's do."""

    def __init__(self, fill: int) -> None:
        self.nbytes = SEG
        self.tensor = torch.full((SEG,), fill, dtype=torch.uint8)
        self.queued: list[LateCopy] = []

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> LateCopy:
        copy = LateCopy(dst[:length], self.tensor[src:src + length])
        self.queued.append(copy)
        return copy


class Failing(Region):
    nbytes = SEG

    def read_into(self, dst: torch.Tensor, src: int, length: int) -> None:
        raise OSError("the source went away mid-piece")


def piece_of(n: int) -> Piece:
    return Piece(offset=0, length=n * SEG,
                 segments=tuple(Segment(source=i, src=0, dst=i * SEG, length=SEG, slot=0) for i in range(n)))


def test_copies_queued_before_a_failing_segment_have_landed_when_the_piece_fails() -> None:
    first, second = DeviceLike(1), DeviceLike(2)
    chunk = Chunk(3 * SEG)
    with pytest.raises(OSError, match="mid-piece"):
        copy_piece(piece_of(3), chunk, [first, second, Failing()])
    assert all(c.landed for c in first.queued + second.queued), "a copy was still in flight when the piece failed"
    # nothing can write into the chunk any more: the next snapshot that takes it keeps its own bytes
    chunk.tensor.zero_()
    assert not chunk.tensor.any()


def test_a_trainer_that_gave_up_mid_piece_stops_it_after_its_queued_copies_landed() -> None:
    regions = [DeviceLike(1), DeviceLike(2), DeviceLike(3)]

    def before(region: Region) -> None:
        if region is regions[2]:
            raise RuntimeError("the trainer gave up on this snapshot")

    with pytest.raises(RuntimeError, match="gave up"):
        copy_piece(piece_of(3), Chunk(3 * SEG), regions, before)
    assert not regions[2].queued, "the piece went on copying after its trainer gave up"
    assert all(c.landed for r in regions[:2] for c in r.queued)


def test_a_piece_that_succeeds_checksums_the_landed_bytes() -> None:
    regions = [DeviceLike(7), DeviceLike(9)]
    chunk = Chunk(2 * SEG)
    copy_piece(piece_of(2), chunk, regions)
    sums = checksums(piece_of(2), chunk)
    assert [s[:2] for s in sums] == [(0, 0), (1, 0)]
    assert bytes(chunk.view[:SEG]) == b"\x07" * SEG and bytes(chunk.view[SEG:]) == b"\x09" * SEG
