"""Streaming a checkpoint file's data region in checked pieces, on several threads: every load, and ``verify``.

The region is cut into whole pieces of the format (each checksummed segment lies inside
one), and READ_THREADS threads take them in
turn. Each piece goes in STEP reads: hashed while it is in the CPU's cache, its zip headers
compared, then (an in-place load) copied out to the tensors it belongs to. Where the bytes
come from and go:

- a fresh load from disk (``Stream.read_region``): straight into one fresh buffer for the
  whole region with O_DIRECT (the read faults its pages in; mapping each piece's pages in one
  call first was slower: 1.044 s against 0.930 s at 1.5 GB, 5 of 5 runs), and every
  storage a slice of that buffer afterwards: no second copy;
- a fresh load of a replica on tmpfs: its pages mapped copy-on-write (``region_buffer``: they
  are memory already), and only hashed;
- an in-place load (``Stream.fill``, with targets) into CPU tensors laid out in memory as in the
  file (a format-3 file's large storages start where torch's large CPU tensors do, 64 bytes past
  a page: format.DIRECT_PHASE): with O_DIRECT, each step's whole blocks of those tensors straight
  into them in one preadv, as a raw read into a reused buffer, the rest (zip headers, the first
  and last bytes of each tensor, GPU targets' and other tensors' bytes) into a small bounce
  buffer per thread and copied out of it;
- an in-place load into CPU tensors that mostly are not so aligned (a format-2 file, another
  allocator; a tmpfs replica): through the page cache (``open_sequential``: the kernel reads
  ahead while the threads copy; a tmpfs replica is read, not mapped), each step's bytes straight
  into its CPU targets in one preadv, the rest into the bounce buffer;
- an in-place load whose bytes go mostly to GPUs: with O_DIRECT into each thread's page-locked
  bounce buffer, and from there over the thread's stream to the GPU: no pageable copy on the
  way (a replica on tmpfs is its pages already). Reading a replica costs no page tables, and no
  fault per 4 KiB page where a global ``echo 3 > /proc/sys/vm/drop_caches`` turned fault-around
  off for a replica the daemon could not lock (daemon/replica/locks.py).

A checksum or zip header that does not match, or a file that ends early, raises
CorruptCheckpointError naming the tensor: a load never returns what it could not check.
Every checksum of the data region is checked here (``Stream._piece``), for ``verify`` too,
which streams the region with no targets and so never imports torch: torch is imported
where a target is a tensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from datastates.protocol.errors import CorruptCheckpointError
from datastates.protocol.fanout import map_on_threads
from datastates.protocol.format import DATA_ALIGN, align_up, checksummer
from datastates.protocol.storage import backend_for
from datastates.protocol.tags import file_commits

from .checks import CheckpointFile, check_bounds, check_local_headers, open_file, storage_error
from .source import Source, open_source, region_buffer

if TYPE_CHECKING:
    import torch

READ_PIECE = 64 << 20
READ_THREADS = 4


class Target:
    """Where a storage's bytes go: an entry's tensor of ``into`` whose memory they are (``direct``), or a fresh
    uint8 buffer of the storage's size."""

    def __init__(self, tensor: torch.Tensor, direct: bool) -> None:
        import torch

        self.tensor = tensor
        self.direct = direct
        self.on_gpu = tensor.device.type == "cuda"
        self.flat = tensor.reshape(-1).view(torch.uint8)
        """Its bytes, as a GPU copy addresses them."""
        self.address = tensor.data_ptr()
        nbytes = self.flat.numel()
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.address)).cast("B") \
            if nbytes and not self.on_gpu else None
        """Its bytes as a CPU buffer, for a read straight into them (``Stream._scatter``)."""


class _Bounce:
    """One read thread's page-aligned buffer of STEP bytes (O_DIRECT needs the alignment) for what is not read
    straight into a target, page-locked where a GPU copy reads it, with a stream per GPU the targets are on (a copy
    runs on its target device's current stream)."""

    def __init__(self, ready: dict[torch.device, torch.cuda.Event]) -> None:
        """``ready``: per GPU the targets are on, an event recorded on its current stream when the load began; this
        buffer's copies wait for it, so they land after the job's kernels queued on those tensors."""
        self.buf = mmap.mmap(-1, STEP)
        self.view = memoryview(self.buf)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.tensor: torch.Tensor | None = None
        """The buffer as a tensor, where a GPU copy reads it."""
        self.streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Event]] = {}
        if ready:  # a GPU load: torch and the CUDA runtime are loaded already; verify imports neither
            import torch

            from datastates.protocol.cudart import host_register

            self.tensor = torch.frombuffer(self.buf, dtype=torch.uint8)
            err = host_register(self.address, STEP)
            if err:
                raise RuntimeError(f"cudaHostRegister of a {STEP}-byte restore buffer failed: error {err}")
            for device, event in ready.items():
                stream = torch.cuda.Stream(device)
                stream.wait_event(event)
                self.streams[device] = (stream, torch.cuda.Event())

    def settle(self) -> None:
        """Wait for this buffer's GPU copies, before it is read into again."""
        for _, event in self.streams.values():
            event.synchronize()

    def close(self) -> None:
        self.settle()
        if self.streams:
            from datastates.protocol.cudart import host_unregister

            host_unregister(self.address)
        self.view.release()
        self.tensor = None


STEP = 8 << 20
"""The bytes one thread of an in-place load reads, checks and copies out at a time: small enough to stay in the CPU's
cache between its read and its copy, and to make the bounce buffers cheap to allocate. A fresh load copies nothing
out and reads whole READ_PIECE pieces (bench/restore.py at 1.5 GB: 0.93 of a raw O_DIRECT read into a fresh buffer,
against 0.70 with 8 MiB reads)."""


STEP_THREADS = 8
"""Threads of an in-place load read with O_DIRECT: each has one STEP read in flight at a time, and the
disk wants about 64 MiB in flight (raw O_DIRECT reads of a 1.5 GB file here, one quiet run and one loaded: 8 x 8 MiB
at 1.42 and 1.58 GB/s, 4 x 8 MiB at 1.31 and 1.31, 4 x 64 MiB at 1.24 and 1.41). A load read through the page cache
has the kernel's read-ahead in flight and is bound by its copies: READ_THREADS."""


@dataclass(frozen=True)
class Straight:
    """A storage's bytes ``lo..hi`` of the data region, read straight into its target in one step."""

    start: int
    """Where the storage starts in the data region."""
    view: memoryview
    """The target's bytes."""
    lo: int
    hi: int


@dataclass
class ReadUnit:
    """One of the format's pieces of the data region (or several): read, checked and copied out by one thread."""

    start: int
    stop: int
    segments: list[tuple[int, int, int, bytes]] = field(default_factory=list)
    """(storage, start, length, checksum) of each checksummed segment inside this piece."""
    headers: list[tuple[int, bytes]] = field(default_factory=list)
    """The zip local headers that meet this piece (``ZipLayout.storage_headers``), checked as its steps are read."""
    targets: list[tuple[int, int, int, Target]] = field(default_factory=list)
    """(storage, start, stop, target) of each storage that meets this piece, by start, relative to the data region."""


class Stream:
    """The data region read piece by piece, in STEP reads, into its targets; every byte hashed on the way.

    A segment's checksum covers up to a whole piece, so its bytes reach their tensor before
    it is known: a mismatch raises (CorruptCheckpointError naming the tensor), and the load
    never returns, though ``into`` may hold some of the bad bytes by then.
    """

    def __init__(self, file: CheckpointFile, targets: dict[int, Target] | None, verify: bool,
                 parts: dict[int, tuple[int, int]] | None = None) -> None:
        """``targets``: each storage's Target (an in-place load); None for a fresh load, which checks every
        storage and copies none out. ``verify``: every piece read is checked against its checksums and (a whole
        read) the zip headers in it. ``parts``: the bytes ``lo..hi`` of its storage each target holds, where not all
        (a slice of a stored tensor): then only the file's pieces of the format that hold them are read and checked,
        and no others."""
        self.path, self.header, self.base, self.end = file.path, file.header, file.base, file.end
        path, header, layout = file.path, file.header, file.layout if parts is None else None
        size = header.piece_size * max(1, READ_PIECE // header.piece_size)
        """Whole pieces of the format: each checksummed segment lies inside one, read by one thread."""
        self.pieces = [ReadUnit(at, min(self.end - self.base, at + size))
                       for at in range(0, self.end - self.base, size)]
        for at, expected in layout.storage_headers() if layout is not None and verify else ():
            for piece in self.pieces[at // size:(at + len(expected) - 1) // size + 1]:
                piece.headers.append((at, expected))
        starts: dict[int, int] = {}
        """Where each target's first byte lies in the data region."""
        for index, target in (targets if targets is not None else dict.fromkeys(range(len(header.storages)))).items():
            rec = header.storages[index]
            segs = check_bounds(path, header, index, self.end - self.base)
            lo, hi = (parts or {}).get(index, (0, rec.nbytes))
            first, last = rec.offset + lo, rec.offset + hi
            starts[index] = first
            for (start, length), want in zip(segs, rec.checksums) if verify else ():
                if start < last and start + length > first:
                    self.pieces[start // size].segments.append((index, start, length, want))
            for piece in self.pieces[first // size:(last - 1) // size + 1] if target and last > first else ():
                piece.targets.append((index, first, last, target))
        for piece in self.pieces:
            piece.targets.sort(key=lambda t: t[1])
        self.partial = parts is not None
        if self.partial:
            self.pieces = [p for p in self.pieces if p.segments or p.targets]
        self.scatter = self.aligned = False
        """Read a step straight into its CPU targets (one preadv; an in-place load), and whether the reads are
        O_DIRECT (then only the ``matched`` targets' whole blocks are read straight). Set by ``fill``."""
        self.matched = {i for i, t in (targets or {}).items()
                        if t and t.view is not None and (t.address - starts[i]) % DATA_ALIGN == 0}
        """The CPU targets whose memory is aligned as their bytes are in the file: O_DIRECT reads into them."""
        nbytes = {i: t.flat.numel() for i, t in (targets or {}).items() if t}
        on_gpu = sum(nbytes[i] for i, t in (targets or {}).items() if t and t.on_gpu)
        self.direct = (on_gpu + sum(nbytes[i] for i in self.matched)) * 2 > sum(nbytes.values())
        """An in-place load whose bytes go mostly to GPUs or to matched targets reads with O_DIRECT: into the
        page-locked bounce buffers, where the page cache would put a pageable copy on the GPUs' way, and straight
        into the matched targets, where it would put a copy on theirs."""
        self.ready: dict[torch.device, torch.cuda.Event] = {}
        """Where the job's queued work on the targets ends (``_Bounce``)."""
        for device in {t.tensor.device for t in (targets or {}).values() if t.on_gpu}:
            import torch

            self.ready[device] = torch.cuda.current_stream(device).record_event()

    def read_region(self) -> mmap.mmap | None:
        """A fresh load: the whole data region in one buffer (None if empty), every piece checked as it lands; a
        file on tmpfs is mapped copy-on-write (``region_buffer``) and only checked."""
        if self.end <= self.base:
            return None
        with open_source(self.path, "direct") as source:
            buf = region_buffer(source, self.base, self.end)
            view = memoryview(buf)
            try:
                if self.pieces:
                    self._threads(source, (view, ctypes.addressof(ctypes.c_char.from_buffer(buf))),
                                  fill=not source.mapped)
            finally:
                view.release()
        return buf

    def fill(self) -> None:
        """An in-place load: every piece read (in STEP reads, into the targets or the threads' bounce buffers),
        checked and copied out to its targets; the first failure is raised."""
        if not self.pieces:
            return
        with open_source(self.path, "direct" if self.direct else "sequential") as source:
            self.scatter, self.aligned = True, source.direct
            self._threads(source, None, fill=False)

    def _threads(self, source: Source, region: tuple[memoryview, int] | None, fill: bool) -> None:
        """The pieces on READ_THREADS threads: from ``region`` (the region in memory and its address; read into it
        first if ``fill``), or, without one, each read into the thread's bounce buffer."""
        @contextlib.contextmanager
        def reader() -> Iterator[Callable[[ReadUnit], None]]:
            bounce = _Bounce(self.ready) if region is None else None
            try:
                yield lambda piece: self._piece(piece, source, region, fill, bounce)
            finally:
                if bounce is not None:
                    bounce.close()  # waits for its GPU copies: an error of one fails the load too

        count = source.streams or (STEP_THREADS if region is None and self.aligned else READ_THREADS)
        map_on_threads(reader, self.pieces, count, "ds-read")

    def _piece(self, piece: ReadUnit, source: Source, region: tuple[memoryview, int] | None, fill: bool,
               bounce: _Bounce | None) -> None:
        """``piece`` in STEP reads (or found in ``region``), each hashed and copied out; then its segments'
        checksums compared: the one check of the data's checksums."""
        hashes = [checksummer() for _ in piece.segments]
        step = READ_PIECE if fill else STEP  # a fresh load copies nothing out: large reads serve the disk better
        for at, stop, last in ((at, min(last, at + step), last) for first, last in self._spans(piece)
                               for at in range(first, last, step)):
            until = self.base + last  # an object's GET reads on to the span's end: one request for its steps
            straight = None
            if region is not None:
                data, address = region[0][at:stop], region[1] + at
                if fill:
                    self._read(source, [data], self.base + at, until)
            else:
                assert bounce is not None
                bounce.settle()  # its previous step's GPU copies read it still
                straight = self._scatter(source, piece, at, stop, bounce, until) if self.scatter else None
                if straight is None:
                    self._read(source, [bounce.view[:stop - at]], self.base + at, until)
                data, address = bounce.view[:stop - at], bounce.address
            straight = straight or {}
            self._copy(piece, at, stop, address, bounce, straight)  # first: a straight target's ends come from here
            for h, (index, start, length, _) in zip(hashes, piece.segments):
                lo, hi = max(start, at), min(start + length, stop)
                done = straight.get(index)
                if lo >= hi:
                    continue
                if done is None:
                    h.update(data[lo - at:hi - at])
                    continue
                # its target's bytes are in the target (read straight, or copied there first); a segment's bytes
                # beside a slice of its storage (a partial load) are in the bounce buffer
                mid_lo = min(max(lo, done.start), hi)
                mid_hi = max(min(hi, done.start + len(done.view)), mid_lo)
                h.update(data[lo - at:mid_lo - at])
                h.update(done.view[mid_lo - done.start:mid_hi - done.start])
                h.update(data[mid_hi - at:hi - at])
            check_local_headers(self.path, piece.headers, data, at)
        for h, (index, start, length, want) in zip(hashes, piece.segments):
            if h.digest() != want:
                raise storage_error(self.path, self.header, index, f"checksum mismatch in bytes "
                                    f"{start - self.header.storages[index].offset}..+{length} (the data is corrupt)")

    def _spans(self, piece: ReadUnit) -> list[tuple[int, int]]:
        """The bytes of ``piece`` to read: all of it; for a partial load, the blocks that hold its segments (which
        hold its targets' bytes), runs closer than PARTIAL_GAP read as one. A resharded DCP load asks a file for a
        few scalars scattered through it (each parameter's optimizer step): not the whole piece between them."""
        if not self.partial:
            return [(piece.start, piece.stop)]
        spans: list[tuple[int, int]] = []
        for lo, hi in sorted([(at, at + n) for _, at, n, _ in piece.segments]
                             + [(lo, hi) for _, lo, hi, _ in piece.targets]):
            lo, hi = max(piece.start, lo // DATA_ALIGN * DATA_ALIGN), min(piece.stop, align_up(hi, DATA_ALIGN))
            if spans and lo <= spans[-1][1] + PARTIAL_GAP:
                spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
            else:
                spans.append((lo, hi))
        return spans

    def _scatter(self, source: Source, piece: ReadUnit, at: int, stop: int, bounce: _Bounce,
                 until: int) -> dict[int, Straight] | None:
        """Bytes ``at..stop`` read in one preadv: each CPU target's part straight into it (with O_DIRECT, a
        ``matched`` target's whole blocks), the rest (zip headers, GPU targets' bytes, a target's ends) into the
        bounce buffer at its place. The storages read straight; None where any two targets' bytes overlap (a
        crafted file of format 1), read the plain way instead: every target's bytes from the bounce buffer."""
        buffers: list[memoryview] = []
        straight: dict[int, Straight] = {}
        pos = reach = at
        for index, start, end, target in piece.targets:
            lo, hi = max(start, at), min(end, stop)
            if lo < reach and lo < hi:
                return None
            reach = max(reach, hi)
            if self.aligned:  # both sides of an O_DIRECT read on DATA_ALIGN: the step's ends are, the target's not
                if index not in self.matched:
                    continue
                lo, hi = align_up(lo, DATA_ALIGN), hi // DATA_ALIGN * DATA_ALIGN
            if lo >= hi or target.view is None:
                continue
            if lo > pos:
                buffers.append(bounce.view[pos - at:lo - at])
            buffers.append(target.view[lo - start:hi - start])
            straight[index] = Straight(start, target.view, lo, hi)
            pos = hi
        if pos < stop:
            buffers.append(bounce.view[pos - at:stop - at])
        self._read(source, buffers, self.base + at, until)
        return straight

    def _copy(self, piece: ReadUnit, at: int, stop: int, address: int, bounce: _Bounce | None,
              straight: dict[int, Straight]) -> None:
        """Bytes ``at..stop`` of the data region, at ``address`` (the bounce buffer), into the targets they belong to
        (but the bytes read ``straight`` into them already)."""
        for index, start, end, target in piece.targets:
            lo, hi = max(start, at), min(end, stop)
            done = straight.get(index)
            for lo, hi in ((lo, hi),) if done is None else ((lo, done.lo), (done.hi, hi)):
                if lo >= hi:
                    continue
                if not target.on_gpu:
                    ctypes.memmove(target.address + lo - start, address + lo - at, hi - lo)
                    continue
                assert bounce is not None and bounce.tensor is not None
                import torch

                stream, _ = bounce.streams[target.tensor.device]
                with torch.no_grad(), torch.cuda.stream(stream):
                    target.flat[lo - start:hi - start].copy_(bounce.tensor[lo - at:hi - at], non_blocking=True)
        if bounce is not None:
            for stream, event in bounce.streams.values():
                event.record(stream)

    def _read(self, source: Source, buffers: list[memoryview], at: int, until: int) -> None:
        """Fill ``buffers``, in order, from byte ``at`` of the file; the thread's reads go on to byte ``until``."""
        buffers = [b for b in buffers if len(b)]
        while buffers:
            got = source.preadv(buffers, at, until)
            if got == 0:
                raise CorruptCheckpointError(f"{self.path}: file ends at byte {at}, inside its data region",
                                             path=self.path)
            at += got
            while buffers and got >= len(buffers[0]):
                got -= len(buffers.pop(0))
            if got:
                buffers[0] = buffers[0][got:]


PARTIAL_GAP = 256 << 10
"""A partial load reads through a gap between two runs it needs rather than read them apart, up to this many bytes:
about what this disk reads in the time one more request costs."""


def verify(path: str | os.PathLike) -> tuple[int, int]:
    """Check a file's size, header, identity and every data checksum without unpickling anything (nor importing
    torch): the reader's sequence up to its stream, with nothing rebuilt.

    Returns (entries, data bytes); raises CorruptCheckpointError or UnsupportedFormatError.
    """
    path = os.fspath(path)
    with backend_for(path).one_read(whole=True):
        file = open_file(path, file_commits(path), views=True, zip_records=True)
        Stream(file, None, verify=True).read_region()
    return len(file.header.entries), file.header.data_len
