"""Reading a checkpoint file's bytes and checking them, with no torch: what ``load`` and ``verify`` share.

``verify`` (and ``datastatesctl verify``) check a file from here alone, so a shell command
that only checks files never pays for importing torch; ``load`` (client/reader.py) reads the
same header and data region through these functions and only then hands them to torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError
from datastates.protocol.fileio import MADV_POPULATE_READ, on_tmpfs, open_for_reading
from datastates.protocol.storage.s3 import READ_STREAMS, ObjectFile, is_object, one_read
from datastates.protocol.format import (
    ARCHIVE,
    DATA_ALIGN,
    INDEX_AT,
    PICKLE_RECORD,
    PREAMBLE_SIZE,
    TORCH_RECORDS,
    FileHeader,
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
from datastates.protocol.tags import listing
from datastates.protocol.tensormeta import check_view
from datastates.protocol.torchzip import data_pkl, local_header

READ_PIECE = 64 << 20
READ_THREADS = 4


def read_region(path: str, start: int, end: int) -> mmap.mmap | None:
    """Bytes ``start..end`` of the file (multiples of 4 KiB) as one buffer, read in parallel; None if empty.

    Large O_DIRECT reads on a few threads into one fresh page-aligned buffer (``region_buffer``),
    about the disk's raw read speed. A tmpfs file is mapped instead; another file system that
    refuses O_DIRECT is read through the page cache. ``datastates.load`` reads through
    client/stream.py instead, checking each piece as it lands.
    """
    if end <= start:
        return None
    buf = region_buffer(path, start, end)
    if on_tmpfs(path):
        return buf
    view = memoryview(buf)
    source = ObjectFile.open(path) if is_object(path) else None
    fd = open_for_reading(path) if source is None else -1
    preadv = source.preadv if source is not None else functools.partial(os.preadv, fd)

    def read(pos: int) -> None:
        stop = min(end, pos + READ_PIECE)
        while pos < stop:
            n = preadv([view[pos - start:stop - start]], pos)
            if n == 0:
                raise CorruptCheckpointError(f"{path}: file ends at byte {pos}, inside its data region", path=path)
            pos += n

    try:
        with ThreadPoolExecutor(READ_STREAMS if source else READ_THREADS, thread_name_prefix="ds-read") as pool:
            list(pool.map(read, range(start, end, READ_PIECE)))
    finally:
        view.release()
        if fd >= 0:
            os.close(fd)
    return buf


def region_buffer(path: str, start: int, end: int) -> mmap.mmap:
    """Where bytes ``start..end`` of the file are read to: for a file on tmpfs, its own pages mapped copy-on-write,
    holding them already; else one fresh page-aligned buffer (O_DIRECT needs the alignment), to be read into."""
    if not is_object(path) and on_tmpfs(path):
        return _map_private(path, start, end)
    buf = mmap.mmap(-1, end - start)
    if FRESH_HUGEPAGES:
        _advise(buf, mmap.MADV_HUGEPAGE)
    return buf


FRESH_HUGEPAGES = False
"""Ask for transparent huge pages for a fresh load's buffer: measured here (bench/restore.py) slower than 4 KiB pages,
the kernel compacting memory to find 2 MiB pages."""


def _map_private(path: str, start: int, end: int) -> mmap.mmap:
    """A tmpfs file's pages are memory already: map them copy-on-write instead of copying them.

    Restores from the daemon's replicas read this way, with no copy at all; a
    trainer that changes a restored tensor gets its own page, never the daemon's.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < end:
            raise CorruptCheckpointError(f"{path}: file ends inside its data region", path=path)
        buf = mmap.mmap(fd, end - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    populate(ctypes.addressof(ctypes.c_char.from_buffer(buf)), len(buf))
    return buf


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(base: int, size: int) -> None:
    """Map every page of the mapping at ``base`` now, in READ_THREADS parallel passes, instead of one fault per 4 KiB
    as the state is checked and used: read faults only, so the daemon's pages stay shared until the trainer writes
    one (MAP_POPULATE would copy them all). ctypes lets go of the GIL for each call, so the passes overlap."""
    part = -(-size // READ_THREADS // mmap.PAGESIZE) * mmap.PAGESIZE
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ds-map") as pool:
        list(pool.map(lambda at: advise(base + at, min(part, size - at), MADV_POPULATE_READ), range(0, size, part)))


def advise(address: int, size: int, advice: int) -> None:
    """madvise(2) of a range, page-aligned ``address``; a kernel that does not know ``advice`` changes nothing."""
    _libc.madvise(address, size, advice)


def _advise(buf: mmap.mmap, advice: int) -> None:
    """A hint to the kernel; an older kernel that does not know it changes nothing."""
    try:
        buf.madvise(advice)
    except OSError:
        pass


@contextlib.contextmanager
def opened(path: str) -> Iterator[tuple[int, Callable[[int, int], bytes]]]:
    """(size, pread(length, at)) of a file, or of an object (protocol/storage/s3.py): for small reads, a head or a tail."""
    if is_object(path):
        yield (source := ObjectFile.open(path)).size, source.pread
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield os.fstat(fd).st_size, functools.partial(os.pread, fd)
    finally:
        os.close(fd)


def read_header(path: str) -> tuple[FileHeader, int, int, ZipLayout | None]:
    """The checked header of ``path``, where its data region starts and ends (padded to DATA_ALIGN), and
    its zip layout (None for format 1)."""
    with opened(path) as (size, pread):
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
    return header, base, base + align_up(header.data_len, DATA_ALIGN), layout


def check_identity(path: str, header: FileHeader) -> None:
    """Refuse a file that is not the snapshot its tag's marker lists: a mix across files, with sound checksums."""
    for marker_path, marker, entry in listing(path):
        if entry.snapshot and entry.snapshot != header.snapshot:
            raise CorruptCheckpointError(
                f"{path}: holds snapshot {header.snapshot or '(unnamed)'}, but tag {marker.tag!r}'s marker "
                f"{marker_path} lists snapshot {entry.snapshot} for it: the file was replaced after the tag was "
                "committed", path=path)


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


def check_segment(path: str, header: FileHeader, index: int, start: int, data: memoryview, want: bytes) -> None:
    """The bytes ``data`` of storage ``index``, at ``start`` in the data region, match their checksum ``want``."""
    if checksum(data) != want:
        lo = start - header.storages[index].offset
        raise storage_error(path, header, index, f"checksum mismatch in bytes {lo}..{lo + len(data)} (the data is corrupt)")


def check_storage(path: str, header: FileHeader, index: int, data: memoryview, verify: bool = True) -> None:
    """Storage ``index`` lies inside the data region ``data``, and (``verify``) each piece matches its checksum."""
    segs = check_bounds(path, header, index, len(data))
    if verify:
        for (start, length), want in zip(segs, header.storages[index].checksums):
            check_segment(path, header, index, start, data[start:start + length], want)


def verify(path: str | os.PathLike) -> tuple[int, int]:
    """Check a file's size, header and every data checksum without unpickling anything (nor importing torch).

    Returns (entries, data bytes); raises CorruptCheckpointError or UnsupportedFormatError.
    """
    path = os.fspath(path)
    with one_read(whole=True):
        header, base, end, layout = read_header(path)
        check_identity(path, header)
        check_views(path, header)
        buf = read_region(path, base, end)
    data = memoryview(buf if buf is not None else b"")
    try:
        for index in range(len(header.storages)):
            check_storage(path, header, index, data)
        if layout is not None:
            check_zip(path, header, layout, data)
    finally:
        data.release()
    return len(header.entries), header.data_len


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


def check_zip(path: str, header: FileHeader, layout: ZipLayout, data: memoryview | None) -> None:
    """What ``torch.load`` reads and the checksums do not cover: every local header, ``data.pkl``, torch's
    small records and the central directory, each as the index implies it. A damaged one would have
    ``torch.load`` fail, or read another record's bytes, where ``datastates.load`` reads the file fine.

    ``data.pkl`` must be, byte for byte, the one the daemon makes from the index's skeleton and tensor entries
    (``data_pkl``; the views checked first, ``check_views``): then ``torch.load`` rebuilds every tensor from the
    storage, offset, shape and stride ``datastates.load`` does. Its checksum alone proves nothing against a
    file made to mislead (its author computes it)."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what} is not what its index implies (torch.load would misread it)",
                                      path=path)

    with opened(path) as (_, pread):
        head = pread(layout.data_offset, 0)
        tail = pread(len(layout.tail), layout.tail_at)
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
    if data is not None:  # None: the caller checks the data region's headers as it streams it (check_local_headers)
        check_local_headers(path, layout.storage_headers(), data)


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

