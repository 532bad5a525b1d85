"""Where the reader's bytes come from: a checkpoint file or object opened for positional reads, with no torch.

The reader's one seam to storage: ``open_source`` gives a ``Source`` (``pread``, ``preadv``,
``size``, ``close``) of the path's storage backend (protocol/storage/), and ``region_buffer``
the memory a data region is read into. Nothing in the reader asks which storage a path has.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

from datastates.protocol.errors import CorruptCheckpointError
from datastates.protocol.fileio import MADV_POPULATE_READ
from datastates.protocol.storage import backend_for
from datastates.protocol.storage.base import RangeReader, Reads

MAP_THREADS = 4
"""Threads that map a tmpfs file's pages in (``populate``)."""


Source = RangeReader
"""A checkpoint file opened for positional reads; ``streams``: reads in flight that serve it best (None: the reader
picks its threads); ``direct``: reads bypass the page cache (buffers and offsets on whole blocks); ``mapped``: its
bytes are memory already (tmpfs), to be mapped rather than read (``region_buffer``)."""


@contextlib.contextmanager
def open_source(path: str, reads: Reads = "small") -> Iterator[Source]:
    """``path`` (a file or an object address) opened for positional reads of the kind ``reads``, closed at the end."""
    source = backend_for(path).open(path, reads)
    try:
        yield source
    finally:
        source.close()


def region_buffer(source: Source, start: int, end: int) -> mmap.mmap:
    """Where bytes ``start..end`` of ``source`` are read to: for a file on tmpfs, its own pages mapped copy-on-write,
    holding them already; else one fresh page-aligned buffer (O_DIRECT needs the alignment), to be read into."""
    if source.mapped:
        return _map_private(source.path, start, end)
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
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def reserve(nbytes: int) -> ctypes.Array | None:
    """``nbytes`` of address space that costs no memory, for what must have an address before its bytes are known
    and is never written (a plan's tensors, given their memory after the stream): a read-only anonymous mapping,
    which no page backs and the kernel does not count against its commit limit, so a state of any size plans.
    Unmapped when the returned buffer is let go; None for 0 bytes."""
    if not nbytes:
        return None
    address = _libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if address is None or address == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), f"mmap of {nbytes} bytes of address space failed")
    buf = (ctypes.c_char * nbytes).from_address(address)
    weakref.finalize(buf, _libc.munmap, address, nbytes)
    return buf


def populate(base: int, size: int) -> None:
    """Map every page of the mapping at ``base`` now, in MAP_THREADS parallel passes, instead of one fault per 4 KiB
    as the state is checked and used: read faults only, so the daemon's pages stay shared until the trainer writes
    one (MAP_POPULATE would copy them all). ctypes lets go of the GIL for each call, so the passes overlap."""
    part = -(-size // MAP_THREADS // mmap.PAGESIZE) * mmap.PAGESIZE
    with ThreadPoolExecutor(MAP_THREADS, thread_name_prefix="ds-map") as pool:
        list(pool.map(lambda at: _libc.madvise(base + at, min(part, size - at), MADV_POPULATE_READ),
                      range(0, size, part)))


def _advise(buf: mmap.mmap, advice: int) -> None:
    """A hint to the kernel; an older kernel that does not know it changes nothing."""
    try:
        buf.madvise(advice)
    except OSError:
        pass
