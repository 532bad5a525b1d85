"""Laying out one snapshot file: where every storage goes and which piece copies it.

Pure logic, no IO: the admitted SNAPSHOT goes in, a frozen FilePlan comes out. The data
region is cut into pieces of one pool chunk each; a piece gathers the parts of the
storages that fall into its file range, so small tensors share one large aligned write
and a large one streams through the pool a chunk at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
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
    local_headers,
    segments,
    storage_records,
    zip_layout,
)
from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.schema import pack
from datastates.protocol.torchzip import Record, data_pkl

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
    entries: bytes = b""
    """The header's entries packed (``pack``), where planned already."""

    @property
    def data_offset(self) -> int:
        return self.layout.data_offset

    @property
    def file_size(self) -> int:
        return self.layout.file_size

    def head(self, sums: list[list[bytes]]) -> bytes:
        """Bytes ``0..data_offset``, the index now with every checksum: written once every piece is."""
        storages = [StorageRecord(s.offset, s.nbytes, c) for s, c in zip(self.header.storages, sums)]
        return self.layout.head_bytes(replace(self.header, storages=storages).encode(entries=self.entries),
                                      self.torch_pkl)


@dataclass(frozen=True)
class _Structure:
    """What a file's plan takes from its entries and its storages' sizes alone: the same for every checkpoint of
    one trainer's state. Planned once and kept (``_structure``): for a state of 100,000 tensors this was 0.8 of
    the planning, and it sat between the trainer's ``snapshot()`` and its ``wait()``."""

    entries: list[EntryDesc]
    """As received: the decoded list, which a state sent again comes back as (protocol/schema.py ``_recalled``)."""
    sizes: list[int]
    root: int
    piece_size: int
    planned: list[EntryDesc]
    """As the providers checked them, for the index."""
    pkl: bytes
    pkl_sum: bytes
    records: list[Record]
    data_len: int
    storages: list[StorageRecord]
    pieces: tuple[Piece, ...]
    entries_packed: bytes
    """``planned`` packed, as the index holds it."""
    storages_len: int
    """The length of ``storages`` packed, for the index's length (``FileHeader.encoded_size``)."""
    layouts: dict[int, ZipLayout] = field(default_factory=dict)
    """Per length of the index, the file's layout: the same as long as the tag and the snapshot's name keep theirs."""

    @property
    def footprint(self) -> int:
        """About the bytes it holds: its pickles, its entries (packed, and as objects), half a KB per storage."""
        return len(self.pkl) + 4 * len(self.entries_packed) + 512 * len(self.sizes)

    def layout(self, header: FileHeader) -> ZipLayout:
        index_len = header.encoded_size(self.storages_len, len(self.entries_packed))
        layout = self.layouts.get(index_len)
        if layout is None:
            layout = zip_layout(header, index_len, storages=self.records)
            with _structures_lock:
                if len(self.layouts) >= LAYOUTS_KEPT:
                    del self.layouts[next(iter(self.layouts))]
                self.layouts[index_len] = layout
        return layout


STRUCTURES_KEPT = 16
STRUCTURES_BYTES = 128 << 20
"""The structures kept take about this much memory at most (``_Structure.footprint``); a larger one is never kept."""
LAYOUTS_KEPT = 4
_structures: list[_Structure] = []
"""The structures planned last, newest first."""
_structures_lock = threading.Lock()


def _structure(msg: m.Snapshot, piece_size: int, keep: bool) -> _Structure:
    """``msg``'s structure: one planned lately for the very same entries (a state sent again) and sizes, else a new
    one, kept if ``keep``. The providers' verdicts may thus be kept: a provider's ``plan`` depends on the entry and
    the sources' sizes only (protocol/providers/base.py)."""
    sizes = [src.nbytes for src in msg.sources]
    with _structures_lock:
        for i, s in enumerate(_structures):
            if s.entries is msg.entries and s.root == msg.root and s.piece_size == piece_size and s.sizes == sizes:
                _structures.insert(0, _structures.pop(i))
                return s
    entries = []
    for entry in msg.entries:
        provider = get_provider(entry.provider)
        if provider is None:
            raise InvalidRequestError(f"entry {entry.name!r}: unknown provider {entry.provider!r} (known: {provider_names()})")
        entries.append(provider.plan(entry, msg.sources))

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
    fills: list[list[tuple[int, bytes]]] = [[] for _ in by_piece]
    for at, data in local_headers(records):  # each storage's, in the data region; one may straddle two pieces
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
    pkl = data_pkl(entries, msg.root, sizes)
    made = _Structure(msg.entries, sizes, msg.root, piece_size, entries, pkl, checksum(pkl) if pkl else b"", records,
                      data_len, storages, pieces, pack(entries), len(pack(storages)))
    if not keep or made.footprint > STRUCTURES_BYTES:
        return made
    with _structures_lock:
        _structures.insert(0, made)
        del _structures[STRUCTURES_KEPT:]
        while sum(kept.footprint for kept in _structures) > STRUCTURES_BYTES:
            _structures.pop()
    return made


def plan_snapshot(msg: m.Snapshot, path: str, piece_size: int, snapshot: str = "", keep: bool = True) -> FilePlan:
    """Check every entry through its provider and lay out the file; raises InvalidRequestError. ``keep``: keep its
    structure for the next snapshot of the same decoded entries (where entries are decoded from messages)."""
    if not msg.entries or len(msg.entries) > MAX_ENTRIES or len(msg.sources) > MAX_ENTRIES:
        raise InvalidRequestError(f"a snapshot needs 1 to {MAX_ENTRIES} entries and sources")
    if not 0 <= msg.root < len(msg.entries):
        raise InvalidRequestError(f"root entry {msg.root} is not one of the {len(msg.entries)} entries")
    s = _structure(msg, piece_size, keep)
    header = FileHeader(
        tag=msg.tag, created_ns=time.time_ns(), piece_size=piece_size, data_len=s.data_len, snapshot=snapshot,
        storages=s.storages, entries=s.planned, root=msg.root, torch_pkl=len(s.pkl), torch_pkl_sum=s.pkl_sum,
    )
    return FilePlan(
        path=path, header=header, pieces=s.pieces, total_bytes=sum(s.sizes),
        layout=s.layout(header), torch_pkl=s.pkl, entries=s.entries_packed,
    )
