"""Reading checkpoints back: ``load`` a file, bitwise (``latest`` is in client/locate.py)."""

from __future__ import annotations

import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from datastates.protocol.fileio import MADV_POPULATE_READ, on_tmpfs, open_for_reading
from datastates.protocol.descriptors import EMPTY, SourceDesc
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError, UnsupportedFormatError
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
from datastates.protocol.providers import get_provider
from datastates.protocol.torchzip import local_header
from datastates.protocol.tags import listing

MapLocation = str | torch.device | None


READ_PIECE = 64 << 20
READ_THREADS = 4


def _read_data(path: str, start: int, end: int) -> torch.UntypedStorage:
    """Bytes ``start..end`` of the file (multiples of 4 KiB) as one storage, read in parallel.

    Large O_DIRECT reads on a few threads into one fresh page-aligned buffer: measured
    here 3-4x faster than faulting a file mapping in, and about the disk's raw read
    speed. A tmpfs file is mapped instead (``_map_private``); another file system that
    refuses O_DIRECT is read through the page cache.
    """
    if end <= start:
        return torch.UntypedStorage(0)
    if on_tmpfs(path):
        return _map_private(path, start, end)
    buf = mmap.mmap(-1, end - start)
    _advise(buf, mmap.MADV_HUGEPAGE)  # fresh pages in 2 MiB faults, not 4 KiB ones, where THP is on "madvise"
    view = memoryview(buf)
    fd = open_for_reading(path)

    def read(pos: int) -> None:
        stop = min(end, pos + READ_PIECE)
        while pos < stop:
            n = os.preadv(fd, [view[pos - start:stop - start]], pos)
            if n == 0:
                raise CorruptCheckpointError(f"{path}: file ends at byte {pos}, inside its data region", path=path)
            pos += n

    try:
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ds-read") as pool:
            list(pool.map(read, range(start, end, READ_PIECE)))
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


def _map_private(path: str, start: int, end: int) -> torch.UntypedStorage:
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
    _populate(buf)
    return torch.frombuffer(buf, dtype=torch.uint8).untyped_storage()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _populate(buf: mmap.mmap) -> None:
    """Map every page of ``buf`` now, in READ_THREADS parallel passes, instead of one fault per 4 KiB as the
    state is checked and used: read faults only, so the daemon's pages stay shared until the trainer writes
    one (MAP_POPULATE would copy them all). ctypes lets go of the GIL for each call, so the passes overlap."""
    size = len(buf)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    part = -(-size // READ_THREADS // mmap.PAGESIZE) * mmap.PAGESIZE
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ds-map") as pool:
        list(pool.map(lambda at: _libc.madvise(base + at, min(part, size - at), MADV_POPULATE_READ),
                      range(0, size, part)))


def _advise(buf: mmap.mmap, advice: int) -> None:
    """A hint to the kernel; an older kernel that does not know it changes nothing."""
    try:
        buf.madvise(advice)
    except OSError:
        pass


class _Restore:
    """The RestoreContext of one file: its storages, read and checked once, and its entries."""

    def __init__(
        self, path: str, data: torch.UntypedStorage, header: FileHeader, verify: bool, device: torch.device | None,
        weights_only: bool = False,
    ) -> None:
        self.path = path
        self.weights_only = weights_only
        self._data = data
        self._header = header
        self._verify = verify
        self._device = device
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._entries: dict[int, Any] = {}
        self._restoring: set[int] = set()
        self._sources = [SourceDesc(kind=EMPTY, handle="", nbytes=rec.nbytes) for rec in header.storages]
        """The storages as a provider's ``plan`` sees a snapshot's sources: only their sizes matter to it."""
        self._users: dict[int, list[str]] = {}
        for e in header.entries:
            if isinstance(e.meta.get("storage"), int):
                self._users.setdefault(e.meta["storage"], []).append(e.name)

    def _fail(self, index: int, why: str) -> CorruptCheckpointError:
        names = ", ".join(repr(n) for n in self._users.get(index, [])[:4]) or f"storage {index}"
        return CorruptCheckpointError(f"{self.path}: tensor {names}: {why}", path=self.path, tensor=names)

    def storage(self, index: int) -> torch.UntypedStorage:
        if index in self._storages:
            return self._storages[index]
        if not 0 <= index < len(self._header.storages):
            raise self._fail(index, "refers to a storage the index does not have")
        rec = self._header.storages[index]
        if rec.offset + rec.nbytes > self._data.nbytes():
            raise self._fail(index, f"lies beyond the data region ({self._data.nbytes()} bytes; truncated)")
        storage = self._data[rec.offset:rec.offset + rec.nbytes]
        if rec.nbytes and self._verify:
            self._check(index, rec, memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()))
        self._storages[index] = storage
        return storage

    def _check(self, index: int, rec: Any, buf: memoryview) -> None:
        segs = segments(rec.offset, rec.nbytes, self._header.piece_size)
        if len(segs) != len(rec.checksums):
            raise self._fail(index, "the index has the wrong number of checksums")
        for (start, length), want in zip(segs, rec.checksums):
            lo = start - rec.offset
            if checksum(buf[lo:lo + length]) != want:
                raise self._fail(index, f"checksum mismatch in bytes {lo}..{lo + length} (the data is corrupt)")

    def entry(self, index: int) -> Any:
        """Entry ``index``, restored once, after its provider checked it as the daemon does at admission.

        A file is as untrusted as a client: a tensor's view beyond its storage, an unknown
        dtype or a skeleton that refers to itself is refused with CorruptCheckpointError
        naming the entry, never met as a torch error or a RecursionError.
        """
        if index not in self._entries:
            if not 0 <= index < len(self._header.entries):
                raise CorruptCheckpointError(f"{self.path}: reference to entry {index}, which does not exist")
            if index in self._restoring:
                raise CorruptCheckpointError(f"{self.path}: entry {index} refers to itself", path=self.path)
            entry = self._header.entries[index]
            provider = get_provider(entry.provider)
            if provider is None:
                raise UnsupportedFormatError(f"{self.path}: entry {entry.name!r} needs provider {entry.provider!r}, not installed")
            try:
                entry = provider.plan(entry, self._sources)
            except InvalidRequestError as exc:
                raise CorruptCheckpointError(f"{self.path}: entry {entry.name!r} is malformed: {exc.message}",
                                             path=self.path) from None
            self._restoring.add(index)
            try:
                self._entries[index] = provider.restore(entry, self)
            finally:
                self._restoring.discard(index)
        return self._entries[index]

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._device is None or self._device.type == "cpu" else tensor.to(self._device)


def load(path: str | os.PathLike, map_location: MapLocation = None, *, verify: bool = True, weights_only: bool = True) -> Any:
    """The state saved at ``path``, bitwise as it was snapshotted.

    The data region is read in one pass of large parallel reads into one buffer, and
    every storage is a slice of it, as with ``torch.load(mmap=True)``: no per-tensor
    allocation and no second copy. With ``verify`` (the default) every byte is checked
    against its checksum.

    Refuses, with CorruptCheckpointError naming the file and the tensor, a file of the
    wrong size, a truncated one, or one whose header or data checksums do not match.
    By default (``weights_only=True``, as ``torch.load`` since torch 2.6) the skeleton goes
    through torch's safe unpickler, which builds tensors, containers, plain values and the
    objects training states commonly hold (numpy arrays and dtypes, RNG states,
    ``torch.Size``, ``argparse.Namespace``; more with ``torch.serialization.add_safe_globals``),
    and raises WeightsOnlyError for anything else. ``weights_only=False`` unpickles anything,
    which runs code the file's author chose: only for files you trust.
    """
    path = os.fspath(path)
    device = torch.device(map_location) if map_location is not None else None
    header, base, end, _ = _read_header(path)
    _check_identity(path, header)
    return _Restore(path, _read_data(path, base, end), header, verify, device, weights_only).entry(header.root)


def _read_header(path: str) -> tuple[FileHeader, int, int, ZipLayout | None]:
    """The checked header of ``path``, where its data region starts and ends (padded to DATA_ALIGN), and
    its zip layout (None for format 1)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        version, at = index_at(os.pread(fd, INDEX_AT, 0), path)
        header_len, header_hash = parse_preamble(os.pread(fd, PREAMBLE_SIZE, at), path, version)
        if at + PREAMBLE_SIZE + header_len > size:
            raise CorruptCheckpointError(f"{path}: file is truncated inside its header ({size} bytes)", path=path)
        header = parse_header(os.pread(fd, header_len, at + PREAMBLE_SIZE), header_hash, path)
    finally:
        os.close(fd)
    layout = None
    if version == 1:
        base, expected = data_offset(header_len), header.file_size(data_offset(header_len))
    else:
        layout = zip_layout(header, PREAMBLE_SIZE + header_len)
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


def _check_identity(path: str, header: FileHeader) -> None:
    """Refuse a file that is not the snapshot its tag's marker lists: a mix across files, with sound checksums."""
    for marker_path, marker, entry in listing(path):
        if entry.snapshot and entry.snapshot != header.snapshot:
            raise CorruptCheckpointError(
                f"{path}: holds snapshot {header.snapshot or '(unnamed)'}, but tag {marker.tag!r}'s marker "
                f"{marker_path} lists snapshot {entry.snapshot} for it: the file was replaced after the tag was "
                "committed", path=path)


def verify(path: str | os.PathLike) -> tuple[int, int]:
    """Check a file's size, header and every data checksum without unpickling anything.

    Returns (entries, data bytes); raises CorruptCheckpointError or UnsupportedFormatError.
    """
    path = os.fspath(path)
    header, base, end, layout = _read_header(path)
    _check_identity(path, header)
    data = _read_data(path, base, end)
    ctx = _Restore(path, data, header, True, None)
    for index in range(len(header.storages)):
        ctx.storage(index)
    if layout is not None:
        _check_zip(path, header, layout, memoryview(torch.empty(0, dtype=torch.uint8).set_(data).numpy()))
    return len(header.entries), header.data_len


def _check_zip(path: str, header: FileHeader, layout: ZipLayout, data: memoryview) -> None:
    """What ``torch.load`` reads and the checksums do not cover: every local header, ``data.pkl``, torch's
    small records and the central directory, each as the index implies it. A damaged one would have
    ``torch.load`` fail, or read another record's bytes, where ``datastates.load`` reads the file fine."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what} is not what its index implies (torch.load would misread it)",
                                      path=path)

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        head = os.pread(fd, layout.data_offset, 0)
        tail = os.pread(fd, len(layout.tail), layout.tail_at)
    finally:
        os.close(fd)
    small = dict(TORCH_RECORDS)
    for rec in layout.head:
        if head[rec.header_offset:rec.data_offset] != local_header(rec):
            raise bad(f"the local header of {rec.name}")
        body = head[rec.data_offset:rec.data_offset + rec.size]
        if rec.name == PICKLE_RECORD and checksum(body) != header.torch_pkl_sum:
            raise bad("data.pkl")
        if rec.name.removeprefix(ARCHIVE + "/") in small and body != small[rec.name.removeprefix(ARCHIVE + "/")]:
            raise bad(rec.name)
    for at, expected in layout.storage_headers():
        if data[at:at + len(expected)] != expected:
            raise bad(f"the local header at byte {at} of the data region")
    if tail != layout.tail:
        raise bad("the central directory")

