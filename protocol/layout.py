"""Laying out one snapshot file: where every storage goes and which piece copies it.

Pure logic, no IO: the admitted SNAPSHOT goes in, a frozen FilePlan comes out. The data
region is cut into pieces of one pool chunk each; a piece gathers the parts of the
storages that fall into its file range, so small tensors share one large aligned write
and a large one streams through the pool a chunk at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from datastates.protocol import messages as m
from datastates.protocol.errors import InvalidRequestError
from datastates.protocol.format import (
    CHECKSUM_BYTES,
    DATA_ALIGN,
    STORAGE_ALIGN,
    FileHeader,
    StorageRecord,
    align_up,
    segments,
)

from .providers import get_provider, provider_names

MAX_ENTRIES = 1 << 20


@dataclass(frozen=True)
class Segment:
    """Copy ``length`` bytes of source ``source`` from ``src`` to ``dst`` within the piece."""

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


@dataclass(frozen=True)
class FilePlan:
    path: str
    header: FileHeader
    data_offset: int
    pieces: tuple[Piece, ...]
    total_bytes: int

    @property
    def file_size(self) -> int:
        return self.header.file_size(self.data_offset)

    def with_checksums(self, sums: list[list[bytes]]) -> FileHeader:
        storages = [replace(s, checksums=c) for s, c in zip(self.header.storages, sums)]
        return replace(self.header, storages=storages)


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

    storages, cursor = [], 0
    for src in msg.sources:
        cursor = align_up(cursor, STORAGE_ALIGN)
        n = len(segments(cursor, src.nbytes, piece_size))
        storages.append(StorageRecord(offset=cursor, nbytes=src.nbytes, checksums=[b"\0" * CHECKSUM_BYTES] * n))
        cursor += src.nbytes
    header = FileHeader(
        tag=msg.tag, created_ns=time.time_ns(), piece_size=piece_size, data_len=cursor, snapshot=snapshot,
        storages=storages, entries=entries, root=msg.root,
    )

    padded = align_up(cursor, DATA_ALIGN)
    by_piece: list[list[Segment]] = [[] for _ in range(0, padded, piece_size)]
    for index, rec in enumerate(storages):
        for slot, (start, length) in enumerate(segments(rec.offset, rec.nbytes, piece_size)):
            base = start // piece_size * piece_size
            by_piece[start // piece_size].append(
                Segment(source=index, src=start - rec.offset, dst=start - base, length=length, slot=slot)
            )
    pieces = tuple(
        Piece(offset=k * piece_size, length=min(piece_size, padded - k * piece_size), segments=tuple(segs))
        for k, segs in enumerate(by_piece)
    )
    return FilePlan(
        path=path, header=header, data_offset=align_up(len(header.encode()), DATA_ALIGN),
        pieces=pieces, total_bytes=sum(s.nbytes for s in msg.sources),
    )
