"""A checkpoint file's header read and checked against everything it implies, with no torch: the reader's first step.

``open_file`` reads the header through the reader's one seam (client/reader/source.py),
checks its size, its layout and the snapshot its tag lists for it, and (``views``, ``zip_records``) its
tensors' views and the zip records ``torch.load`` would read; the data region's checksums
and zip headers are checked as it streams (client/reader/stream.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError
from datastates.protocol.format import (
    ARCHIVE,
    DATA_ALIGN,
    INDEX_AT,
    PICKLE_RECORD,
    PREAMBLE_SIZE,
    TORCH_RECORDS,
    CommitMarker,
    FileHeader,
    MarkerFile,
    ZipLayout,
    align_up,
    checksum,
    data_offset,
    index_at,
    parse_header,
    parse_preamble,
    segments,
    zip_layout,
)
from datastates.protocol.tensormeta import check_view
from datastates.protocol.torchzip import data_pkl, local_header

from .source import Source, open_source

Listed = list[tuple[str, CommitMarker, MarkerFile]]
"""What the commit markers of a file's tag say of it: (marker path, marker, its entry for the file), as
``protocol.tags.file_commits`` finds them."""


@dataclass(frozen=True)
class CheckpointFile:
    """A checkpoint file whose header is read and checked: what the reader plans and streams from."""

    path: str
    header: FileHeader
    base: int
    """Where its data region starts."""
    end: int
    """Where its data region ends, padded to DATA_ALIGN."""
    layout: ZipLayout | None
    """Its zip layout (None for format 1)."""


def open_file(path: str, listed: Listed, *, views: bool, zip_records: bool) -> CheckpointFile:
    """``path``'s header, checked: its size and layout, and the snapshot its tag's markers (``listed``, found by the
    caller) name for it; with ``views``, every tensor's view (``check_views``); with ``zip_records``, the zip records
    outside its data region (``check_zip``). No byte of the data region is read."""
    with open_source(path) as source:
        file = _read_header(path, source)
        check_identity(file, listed)
        if views:
            check_views(path, file.header)
        if zip_records and file.layout is not None:
            check_zip(file, source)
    return file


def _read_header(path: str, source: Source) -> CheckpointFile:
    size, pread = source.size, source.pread
    container, at = index_at(pread(INDEX_AT, 0), path)
    version, header_len, header_hash = parse_preamble(pread(PREAMBLE_SIZE, at), path, container)
    if at + PREAMBLE_SIZE + header_len > size:
        raise CorruptCheckpointError(f"{path}: file is truncated inside its header ({size} bytes)", path=path)
    header = parse_header(pread(header_len, at + PREAMBLE_SIZE), header_hash, path)
    layout = None
    if version == 1:
        base, expected = data_offset(header_len), header.file_size(data_offset(header_len))
    else:
        layout = zip_layout(header, PREAMBLE_SIZE + header_len, version)
        if [s.offset for s in header.storages] != [r.data_offset for r in layout.storages]:
            raise CorruptCheckpointError(f"{path}: header places storages where its zip layout does not", path=path)
        base, expected = layout.data_offset, layout.file_size
    if size != expected:
        raise CorruptCheckpointError(
            f"{path}: file is {size} bytes but its header declares {expected}"
            + (" (truncated)" if size < expected else " (bytes appended)"),
            path=path,
        )
    return CheckpointFile(path, header, base, base + align_up(header.data_len, DATA_ALIGN), layout)


def check_identity(file: CheckpointFile, listed: Listed) -> None:
    """Refuse a file that is not the snapshot its tag's marker lists: a mix across files, with sound checksums."""
    for marker_path, marker, entry in listed:
        if not entry.holds(file.header.snapshot):
            raise CorruptCheckpointError(
                f"{file.path}: holds snapshot {file.header.snapshot or '(unnamed)'}, but tag {marker.tag!r}'s marker "
                f"{marker_path} lists snapshot {entry.snapshot} for it: the file was replaced after the tag was "
                "committed", path=file.path)


def storage_error(path: str, header: FileHeader, index: int, why: str) -> CorruptCheckpointError:
    """A damaged storage, reported by the names of the tensors that use it (the first four)."""
    users = [e.name for e in header.entries if isinstance(e.meta.get("storage"), int) and e.meta["storage"] == index]
    names = ", ".join(repr(n) for n in users[:4]) or f"storage {index}"
    return CorruptCheckpointError(f"{path}: tensor {names}: {why}", path=path, tensor=names)


def check_bounds(path: str, header: FileHeader, index: int, region_len: int) -> list[tuple[int, int]]:
    """Storage ``index`` lies inside a data region of ``region_len`` bytes and has one checksum per piece it
    meets; its (start, length) segments, relative to the data region."""
    if not 0 <= index < len(header.storages):
        raise storage_error(path, header, index, "refers to a storage the index does not have")
    rec = header.storages[index]
    if rec.offset + rec.nbytes > region_len:
        raise storage_error(path, header, index, f"lies beyond the data region ({region_len} bytes; truncated)")
    segs = segments(rec.offset, rec.nbytes, header.piece_size) if rec.nbytes else []
    if len(segs) != len(rec.checksums) and rec.nbytes:
        raise storage_error(path, header, index, "the index has the wrong number of checksums")
    return segs


def malformed(path: str, entry: EntryDesc, why: str) -> CorruptCheckpointError:
    """An entry of the index that ``datastates.load`` would not rebuild, by its name."""
    return CorruptCheckpointError(f"{path}: entry {entry.name!r} is malformed: {why}", path=path)


def check_views(path: str, header: FileHeader) -> None:
    """Every tensor entry is a view inside its storage of an element count a real tensor can have (``check_view``),
    as the daemon admitted it and ``datastates.load`` checks it again before rebuilding it."""
    sizes = [rec.nbytes for rec in header.storages]
    for entry in header.entries:
        if entry.provider == "tensor":
            try:
                check_view(entry.name, entry.meta, sizes)
            except InvalidRequestError as exc:
                raise malformed(path, entry, exc.message) from None


def check_zip(file: CheckpointFile, source: Source) -> None:
    """What ``torch.load`` reads and the checksums do not cover: every local header, ``data.pkl``, torch's
    small records and the central directory, each as the index implies it. A damaged one would have
    ``torch.load`` fail, or read another record's bytes, where ``datastates.load`` reads the file fine.

    ``data.pkl`` must be, byte for byte, the one the daemon makes from the index's skeleton and tensor entries
    (``data_pkl``; the views checked first, ``check_views``): then ``torch.load`` rebuilds every tensor from the
    storage, offset, shape and stride ``datastates.load`` does. Its checksum alone proves nothing against a
    file made to mislead (its author computes it). The local headers inside the data region are checked as it
    streams (``check_local_headers``)."""
    path, header, layout = file.path, file.header, file.layout
    assert layout is not None

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what} is not what its index implies (torch.load would misread it)",
                                      path=path)

    head = source.pread(layout.data_offset, 0)
    tail = source.pread(len(layout.tail), layout.tail_at)
    try:
        expected = data_pkl(header.entries, header.root, [rec.nbytes for rec in header.storages])
    except InvalidRequestError as exc:
        raise malformed(path, header.entries[header.root], exc.message) from None
    if len(expected) != header.torch_pkl:
        raise bad(f"data.pkl of {header.torch_pkl} bytes (its skeleton and tensor entries make {len(expected)})")
    small = dict(TORCH_RECORDS)
    for rec in layout.head:
        if head[rec.header_offset:rec.data_offset] != local_header(rec):
            raise bad(f"the local header of {rec.name}")
        body = head[rec.data_offset:rec.data_offset + rec.size]
        if rec.name == PICKLE_RECORD and checksum(body) != header.torch_pkl_sum:
            raise bad("data.pkl")
        if rec.name == PICKLE_RECORD and body != expected:
            at = next((i for i, (a, b) in enumerate(zip(body, expected)) if a != b), len(expected))
            raise CorruptCheckpointError(
                f"{path}: data.pkl is not the one its index's skeleton and tensor entries make (it differs from "
                f"byte {at}): torch.load would rebuild other tensors than datastates.load", path=path)
        if rec.name.removeprefix(ARCHIVE + "/") in small and body != small[rec.name.removeprefix(ARCHIVE + "/")]:
            raise bad(rec.name)
    if tail != layout.tail:
        raise bad("the central directory")


def check_local_headers(path: str, headers: list[tuple[int, bytes]], data: memoryview, start: int = 0) -> None:
    """The storages' local ``headers`` (``ZipLayout.storage_headers``), where they meet ``data`` (bytes ``start..``
    of the data region), are as the layout implies: the part of ``check_zip`` that lies in the data region,
    checkable piece by piece."""
    stop = start + len(data)
    for at, expected in headers:
        lo, hi = max(at, start), min(at + len(expected), stop)
        if lo < hi and data[lo - start:hi - start] != expected[lo - at:hi - at]:
            raise CorruptCheckpointError(f"{path}: the local header at byte {at} of the data region is not what its "
                                         "index implies (torch.load would misread it)", path=path)

