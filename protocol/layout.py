"""Laying out one snapshot file: where every storage goes and which piece copies it.

Pure logic, no IO: the admitted SNAPSHOT goes in, a frozen FilePlan comes out. The data
region is cut into pieces of one pool chunk each; a piece gathers the parts of the
storages that fall into its file range, so small tensors share one large aligned write
and a large one streams through the pool a chunk at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import NamedTuple

from datastates.protocol import messages as m
from datastates.protocol.errors import InvalidRequestError
from datastates.protocol.format import (
    CHECKSUM_BYTES,
    DATA_ALIGN,
    FileHeader,
    StorageRecord,
    ZipLayout,
    align_up,
    checksum,
    segments,
    storage_records,
    zip_layout,
)
from datastates.protocol.torchzip import data_pkl

from .providers import get_provider, provider_names

MAX_ENTRIES = 1 << 20


class Segment(NamedTuple):
    """Copy ``length`` bytes of source ``source`` from ``src`` to ``dst`` within the piece. A tuple: a plan of
    100,000 tensors makes as many, and a frozen dataclass's were a tenth of its planning."""

    source: int
    src: int
    dst: int
    length: int
    slot: int
    """Index of this segment's checksum in its storage's list."""


@dataclass(frozen=True)
class Piece:
    offset: int
    """Offset of the piece in the data region."""
    length: int
    """Bytes written, padded to DATA_ALIGN."""
    segments: tuple[Segment, ...]
    fills: tuple[tuple[int, bytes], ...] = ()
    """Bytes that are not storage bytes, at their offset in the piece: the zip local headers before storages."""


@dataclass(frozen=True)
class FilePlan:
    path: str
    header: FileHeader
    pieces: tuple[Piece, ...]
    total_bytes: int
    layout: ZipLayout
    torch_pkl: bytes
    """``data.pkl``, made from the skeleton (``data_pkl``); empty if it names leaves that are not tensors."""

    @property
    def data_offset(self) -> int:
        return self.layout.data_offset

    @property
    def file_size(self) -> int:
        return self.layout.file_size

    def head(self, sums: list[list[bytes]]) -> bytes:
        """Bytes ``0..data_offset``, the index now with every checksum: written once every piece is."""
        storages = [StorageRecord(s.offset, s.nbytes, c) for s, c in zip(self.header.storages, sums)]
        return self.layout.head_bytes(replace(self.header, storages=storages).encode(), self.torch_pkl)


def plan_snapshot(msg: m.Snapshot, path: str, piece_size: int, snapshot: str = "") -> FilePlan:
    """Check every entry through its provider and lay out the file; raises InvalidRequestError."""
    if not msg.entries or len(msg.entries) > MAX_ENTRIES or len(msg.sources) > MAX_ENTRIES:
        raise InvalidRequestError(f"a snapshot needs 1 to {MAX_ENTRIES} entries and sources")
    if not 0 <= msg.root < len(msg.entries):
        raise InvalidRequestError(f"root entry {msg.root} is not one of the {len(msg.entries)} entries")
    entries = []
    for entry in msg.entries:
        provider = get_provider(entry.provider)
        if provider is None:
            raise InvalidRequestError(f"entry {entry.name!r}: unknown provider {entry.provider!r} (known: {provider_names()})")
        entries.append(provider.plan(entry, msg.sources))

    sizes = [src.nbytes for src in msg.sources]
    records, data_len = storage_records(sizes)
    padded = align_up(data_len, DATA_ALIGN)
    by_piece: list[list[Segment]] = [[] for _ in range(0, padded, piece_size)]
    storages = []
    unsummed = b"\0" * CHECKSUM_BYTES
    for index, rec in enumerate(records):
        offset, nbytes = rec.data_offset, rec.size
        first = offset // piece_size
        if nbytes and (offset + nbytes - 1) // piece_size == first:  # most storages lie in one piece
            by_piece[first].append(Segment(index, 0, offset - first * piece_size, nbytes, 0))
            storages.append(StorageRecord(offset, nbytes, [unsummed]))
            continue
        parts = segments(offset, nbytes, piece_size)
        for slot, (start, length) in enumerate(parts):
            k = start // piece_size
            by_piece[k].append(Segment(index, start - offset, start - k * piece_size, length, slot))
        storages.append(StorageRecord(offset, nbytes, [unsummed] * len(parts)))
    pkl = data_pkl(entries, msg.root, sizes)
    header = FileHeader(
        tag=msg.tag, created_ns=time.time_ns(), piece_size=piece_size, data_len=data_len, snapshot=snapshot,
        storages=storages, entries=entries, root=msg.root, torch_pkl=len(pkl),
        torch_pkl_sum=checksum(pkl) if pkl else b"",
    )
    layout = zip_layout(header, len(header.encode()), storages=records)
    fills: list[list[tuple[int, bytes]]] = [[] for _ in by_piece]
    for at, data in layout.storage_headers():  # a header may straddle two pieces
        first = at // piece_size
        if (at + len(data) - 1) // piece_size == first:
            fills[first].append((at - first * piece_size, data))
            continue
        for start, length in segments(at, len(data), piece_size):
            fills[start // piece_size].append((start % piece_size, data[start - at:start - at + length]))
    pieces = tuple(
        Piece(offset=k * piece_size, length=min(piece_size, padded - k * piece_size), segments=tuple(segs),
              fills=tuple(fills[k]))
        for k, segs in enumerate(by_piece)
    )
    return FilePlan(
        path=path, header=header, pieces=pieces,
        total_bytes=sum(s.nbytes for s in msg.sources), layout=layout, torch_pkl=pkl,
    )

