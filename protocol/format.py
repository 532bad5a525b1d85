"""The on-disk structures, defined once: the checkpoint file and the commit marker.

A checkpoint file (one per ``snapshot()`` call) of format 3 (or 2: the same but for where large storages
start, DIRECT_PHASE) is a zip ``torch.load`` reads
(``ZipLayout``): the index below (preamble and header) as its first record at
``INDEX_AT``, then ``data.pkl`` and torch's small records, zeros to DATA_ALIGN, the data
region, whose storages are zip records each preceded by its local header, and the
central directory. Format 1, which ``datastates.load`` still reads, is::

    preamble   32 bytes  magic, format version, flags, header length, xxh64 of the header
    header     msgpack   FileHeader: tag, storage index with checksums, entries, root
    padding    zeros to DATA_ALIGN
               (the skeleton's persistent ids are plain entry indexes, ints)
    data       each storage's raw bytes at its offset (STORAGE_ALIGN), zero padding between,
               the whole padded to DATA_ALIGN

Storage offsets are relative to the start of the data region, which is
``align_up(PREAMBLE_SIZE + header_len, DATA_ALIGN)``. The data region is cut into pieces of
``piece_size`` bytes; a storage has one xxh3-64 checksum per piece it touches, so pieces
can be copied and checked in parallel. Checksums are fixed-width, so the header's size
is known before a byte is copied. docs/format.md describes the same thing for people.
"""

from __future__ import annotations

import json
import re
import secrets
import struct
from dataclasses import dataclass, replace

import msgpack
import xxhash

from .descriptors import EntryDesc
from .errors import CorruptCheckpointError, DatastatesError, InvalidRequestError, UnsupportedFormatError
from .fileio import read_regular
from .schema import from_dict, pack, plain
from .torchzip import Record, central_directory, local_header, local_header_size, plan_zip
from .version import COMMIT_VERSION, FORMAT_VERSION, READABLE_FORMATS

MAGIC = b"DSTATES\x00"
PREAMBLE = struct.Struct("<8sIIQQ")
PREAMBLE_SIZE = PREAMBLE.size
DATA_ALIGN = 4096
STORAGE_ALIGN = 64
DIRECT_MIN = 1 << 20
DIRECT_PHASE = 64
"""Format 3: a storage of at least DIRECT_MIN bytes starts DIRECT_PHASE bytes past a DATA_ALIGN boundary of the
file, where torch's CPU tensors of that size start in memory (glibc's ``posix_memalign(64)`` maps them, at 64 bytes
past a page). So an in-place load reads such a storage straight into the tensor with O_DIRECT, file and memory
aligned alike (client/reader/stream.py), as fast as a raw read into a reused buffer, and copies no byte out of a bounce
buffer or the page cache. Smaller storages keep STORAGE_ALIGN, as in format 2."""
CHECKSUM_BYTES = 8

TEMP_SUFFIX = ".dstmp"
NAME_MAX = 255
"""The longest file name (bytes) of the file systems datastates writes to."""
TEMP_TOKEN_MAX = 32
"""The longest token a temporary name carries; writers hash a longer one down to this."""
TEMP_RESERVE = len(".") + len(".") + 16 + len("-") + TEMP_TOKEN_MAX + len(TEMP_SUFFIX)
"""What a temporary name ``.<name>.<owner>-<token>.dstmp`` adds to the name of the file it becomes."""
FILE_NAME_MAX = NAME_MAX - TEMP_RESERVE
"""The longest name of a file datastates writes (checkpoint files, markers, trackers): its temporary name must fit."""
STAGING_SUFFIX = ".dsgen"
STAGING_RE = re.compile(r"\.([0-9a-f]{16})-\d+" + re.escape(STAGING_SUFFIX))
"""A re-saved tag's staging folder beside its folder, ``.<owner>-<n>.dsgen`` (daemon/resave.py); the group is
the owner tag of the daemon that made it."""


def staging_name(owner: str, n: int) -> str:
    """The name of a daemon's ``n``-th staging folder (``STAGING_RE``); ``owner`` is its 16-hex-digit owner tag."""
    return f".{owner}-{n}{STAGING_SUFFIX}"


STAGING_NAME_MAX = len(staging_name("0" * 16, 2**64))
"""The longest staging folder name: a daemon's count of them never reaches 2**64."""
DELETING_SUFFIX = ".dsdel"
DELETING_RE = re.compile(r"\.(.+)\.[0-9a-f]{8}" + re.escape(DELETING_SUFFIX))
"""A committed tag's folder being deleted, ``.<tag>.<token>.dsdel`` beside where it was (protocol/retention.py):
renamed so first, in one step, so no reader ever sees it half-deleted; what a killed delete leaves under
this name, the next prune or daemon start deletes."""


def deleting_name(tag: str) -> str:
    """The name a tag's folder is renamed to before it is deleted (DELETING_RE): unique, so deletes never collide."""
    return f".{tag}.{secrets.token_hex(4)}{DELETING_SUFFIX}"


MARKER_PREFIX = "datastates-commit."
MARKER_SUFFIX = ".json"

TAG_MAX = 160
"""Characters of a tag: its markers (``datastates-done.<tag>.node<rank>.json`` the longest) are files too."""
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=-]{0,%d}" % (TAG_MAX - 1))  # fullmatch: "$" would pass "tag\n"


def align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


CHECKSUM_SIZE = 8
"""Bytes of one piece's checksum (xxh3-64)."""
MAX_FILE = 1 << 62
"""More bytes than any file holds: a header's sizes beyond it are crafted (and would not fit a zip's fields)."""


def checksum(data: memoryview | bytes) -> bytes:
    """xxh3-64 of ``data``, big-endian: the per-piece checksum of the format."""
    return xxhash.xxh3_64_digest(data)


def checksummer() -> xxhash.xxh3_64:
    """``checksum`` taken in parts: ``digest()`` after ``update()`` with each part, in order."""
    return xxhash.xxh3_64()


@dataclass(frozen=True)
class StorageRecord:
    offset: int
    nbytes: int
    checksums: list[bytes]


@dataclass(frozen=True)
class FileHeader:
    tag: str
    created_ns: int
    piece_size: int
    data_len: int
    storages: list[StorageRecord]
    entries: list[EntryDesc]
    root: int
    snapshot: str = ""
    """Which snapshot wrote this file: ``<daemon owner>/<client>/<snapshot id>``. Its tag's marker lists the
    same for it, so a file swapped for another snapshot's (same size, sound checksums) is refused on read."""
    torch_pkl: int = 0
    """Format 2: bytes of the ``data.pkl`` record ``torch.load`` reads; 0 if the file has none (its skeleton
    names leaves that are not tensors: ``datastates.load`` alone reads it)."""
    torch_pkl_sum: bytes = b""
    """Format 2: the xxh3-64 of ``data.pkl``, which ``verify`` checks (``torch.load`` checks nothing)."""

    def encode(self, version: int = FORMAT_VERSION, entries: bytes = b"") -> bytes:
        """Preamble + header; its length does not depend on the checksum values. ``entries``: the entries packed
        already (``pack(self.entries)``), the most of a header of many tensors, the same for each of their files."""
        body = pack(self, {"entries": entries} if entries else None)
        return PREAMBLE.pack(MAGIC, version, 0, len(body), xxhash.xxh64_intdigest(body)) + body

    def encoded_size(self, storages_len: int, entries_len: int) -> int:
        """``len(self.encode())`` from the lengths of its storages and its entries packed, without packing them:
        msgpack writes a map field after field, so they add to the length of the header packed with both lists
        empty (one byte each)."""
        return len(replace(self, storages=[], entries=[]).encode()) - 2 + storages_len + entries_len

    def file_size(self, data_offset: int) -> int:
        return data_offset + align_up(self.data_len, DATA_ALIGN)

    def check(self, path: str) -> None:
        """Every size, offset and count against the others, before a reader allocates or loops on any of them.

        The header's own checksum proves nothing against a crafted file (its author computes
        it), so a piece size of 0 or 1, a storage beyond the data region or a checksum count
        that does not match must be refused here, not met as a ZeroDivisionError or a list
        of a billion segments.
        """
        def bad(why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{path}: header {why}", path=path)

        if self.piece_size < DATA_ALIGN or self.piece_size % DATA_ALIGN:
            raise bad(f"piece_size {self.piece_size} is not a positive multiple of {DATA_ALIGN}")
        if not 0 <= self.data_len < MAX_FILE:
            raise bad(f"data_len {self.data_len} is negative or beyond any file")
        if not 0 <= self.torch_pkl < MAX_FILE or len(self.torch_pkl_sum) not in (0, CHECKSUM_SIZE):
            raise bad(f"torch_pkl {self.torch_pkl} or its checksum ({len(self.torch_pkl_sum)} bytes) is malformed")
        for i, rec in enumerate(self.storages):
            if rec.offset < 0 or rec.nbytes < 0 or rec.offset + rec.nbytes > self.data_len:
                raise bad(f"storage {i} (bytes {rec.offset}..{rec.offset + rec.nbytes}) lies outside the data "
                          f"region ({self.data_len} bytes)")
            first, last = rec.offset // self.piece_size, (rec.offset + rec.nbytes - 1) // self.piece_size
            pieces = last - first + 1 if rec.nbytes else 0
            if len(rec.checksums) != pieces or any(len(c) != CHECKSUM_SIZE for c in rec.checksums):
                raise bad(f"storage {i} has {len(rec.checksums)} checksums for the {pieces} pieces it touches")
        if not 0 <= self.root < len(self.entries):
            raise bad(f"names root entry {self.root}, but it has {len(self.entries)} entries")


def data_offset(header_len: int) -> int:
    """Start of the data region for a header of ``header_len`` bytes (preamble excluded)."""
    return align_up(PREAMBLE_SIZE + header_len, DATA_ALIGN)


def segments(offset: int, nbytes: int, piece_size: int) -> list[tuple[int, int]]:
    """The (start, length) ranges, relative to the data region, where a storage meets each piece."""
    out = []
    pos, end = offset, offset + nbytes
    while pos < end:
        stop = min(end, (pos // piece_size + 1) * piece_size)
        out.append((pos, stop - pos))
        pos = stop
    return out


def parse_preamble(raw: bytes, path: str, container: int = 1) -> tuple[int, int, int]:
    """(format version, header length, header xxh64) from the PREAMBLE_SIZE bytes of ``path``'s index, which must
    be of a format of ``container`` (``index_at`` tells which the file's first bytes say: 1, or 2 for a zip of
    format 2 or later)."""
    if len(raw) < PREAMBLE_SIZE:
        raise CorruptCheckpointError(f"{path}: file is truncated ({len(raw)} bytes, no full preamble)", path=path)
    magic, found, _flags, header_len, header_hash = PREAMBLE.unpack(raw[:PREAMBLE_SIZE])
    if magic != MAGIC:
        raise UnsupportedFormatError(f"{path}: not a datastates checkpoint (bad magic {magic!r})", path=path)
    if found not in READABLE_FORMATS:
        raise UnsupportedFormatError(
            f"{path}: format version {found} is not supported (this reader knows {', '.join(map(str, READABLE_FORMATS))})",
            path=path)
    if (found == 1) != (container == 1):
        raise CorruptCheckpointError(f"{path}: an index of format {found} in a file laid out as format {container}",
                                     path=path)
    return found, header_len, header_hash


ARCHIVE = "archive"
"""The folder every record of a format-2 file is named under (torch takes the first record's)."""
INDEX_RECORD = f"{ARCHIVE}/.data/datastates/index"
PICKLE_RECORD = f"{ARCHIVE}/data.pkl"
TORCH_RECORDS = ((".format_version", b"1"), (".storage_alignment", str(STORAGE_ALIGN).encode()),
                 ("byteorder", b"little"), ("version", b"3\n"))
"""The small records ``torch.save`` writes, with its values: ``torch.load`` needs ``version``."""
INDEX_AT = local_header_size(INDEX_RECORD)
"""Where a format-2 file's index (preamble and header) starts: right after its record's local header."""
ZIP_MAGIC = b"PK\x03\x04"


def index_at(first: bytes, path: str) -> tuple[int, int]:
    """(container, offset of the index) from the first INDEX_AT bytes of ``path``: container 1 is format 1, 2 a zip
    (format 2 or later: its preamble says which)."""
    if first[:len(MAGIC)] == MAGIC:
        return 1, 0
    if len(first) < INDEX_AT and (MAGIC.startswith(first) or first.startswith(ZIP_MAGIC) or ZIP_MAGIC.startswith(first)):
        raise CorruptCheckpointError(f"{path}: file is truncated ({len(first)} bytes, before its index)", path=path)
    if first[:len(ZIP_MAGIC)] != ZIP_MAGIC:
        raise UnsupportedFormatError(f"{path}: not a datastates checkpoint (it starts {first[:8]!r})", path=path)
    if first[local_header_size(""):INDEX_AT] != INDEX_RECORD.encode():
        raise UnsupportedFormatError(f"{path}: not a datastates checkpoint: a zip without a datastates index "
                                     "(a torch.save file? read it with torch.load)", path=path)
    return 2, INDEX_AT


def storage_records(sizes: list[int], version: int = FORMAT_VERSION) -> tuple[list[Record], int]:
    """Formats 2 and 3: each storage's record, offsets relative to the data region, and the region's length. The
    region starts on DATA_ALIGN, which every alignment divides, so they do not depend on what comes before."""
    def place(n: int) -> tuple[int, int]:
        return (DATA_ALIGN, DIRECT_PHASE) if version >= 3 and n >= DIRECT_MIN else (STORAGE_ALIGN, 0)

    return plan_zip([(f"{ARCHIVE}/data/{k}", n, *place(n)) for k, n in enumerate(sizes)])


def local_headers(records: list[Record]) -> list[tuple[int, bytes]]:
    """Each record's local header, at its header offset."""
    return [(r.header_offset, local_header(r)) for r in records]


@dataclass(frozen=True)
class ZipLayout:
    """Where everything of a format-2 file lies, from its header alone: the writer plans by it, the reader checks by it."""

    head: list[Record]
    """The index, ``data.pkl`` and torch's small records, in that order, from offset 0."""
    storages: list[Record]
    """Relative to the data region."""
    data_offset: int
    tail_at: int
    """Where the central directory starts: the data region's end, padded to DATA_ALIGN."""
    tail: bytes

    @property
    def file_size(self) -> int:
        return self.tail_at + len(self.tail)

    def storage_headers(self) -> list[tuple[int, bytes]]:
        """Each storage's local header, at its offset relative to the data region: bytes of the data region."""
        return local_headers(self.storages)

    def head_bytes(self, index: bytes, pickle: bytes) -> bytes:
        """Bytes ``0..data_offset``: every head record with its local header, zeros to the data region."""
        contents = [index, *([pickle] if len(self.head) > 1 + len(TORCH_RECORDS) else []), *(v for _, v in TORCH_RECORDS)]
        if [len(c) for c in contents] != [r.size for r in self.head]:
            raise ValueError("the head's contents do not have the sizes its layout was planned for")
        out = b"".join(local_header(rec) + data for rec, data in zip(self.head, contents))
        return out + bytes(self.data_offset - len(out))


def zip_layout(header: FileHeader, index_len: int, version: int = FORMAT_VERSION,
               storages: list[Record] | None = None) -> ZipLayout:
    """The layout of a file of format ``version`` (2 or later) whose index is ``index_len`` bytes (preamble
    included); ``storages``: its ``storage_records``, where the caller has them already."""
    head, end = plan_zip([(INDEX_RECORD, index_len, 1, 0)]
                         + [(PICKLE_RECORD, header.torch_pkl, 1, 0)] * bool(header.torch_pkl)
                         + [(f"{ARCHIVE}/{name}", len(value), 1, 0) for name, value in TORCH_RECORDS])
    if storages is None:
        storages, _ = storage_records([s.nbytes for s in header.storages], version)
    base = align_up(end, DATA_ALIGN)
    tail_at = base + align_up(header.data_len, DATA_ALIGN)
    placed = [Record(r.name, r.size, r.header_offset + base, r.data_offset + base) for r in storages]
    return ZipLayout(head, storages, base, tail_at, central_directory(head + placed, tail_at))


def parse_header(body: bytes, expected_hash: int, path: str) -> FileHeader:
    _check_header_sum(body, expected_hash, path)
    try:
        header = from_dict(FileHeader, msgpack.unpackb(body, raw=False), "header")
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: header does not decode: {exc}", path=path) from None
    header.check(path)
    return header


def header_snapshot(body: bytes, expected_hash: int, path: str) -> str:
    """The header's ``snapshot`` alone, every other field skipped undecoded: a commit asks it of every file it
    lists, and building a header of 100,000 entries took 3 s (decoding its map alone, 0.7 s)."""
    _check_header_sum(body, expected_hash, path)
    snapshot: object = ""
    try:
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(body)
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "snapshot":
                snapshot = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception as exc:
        raise CorruptCheckpointError(f"{path}: header does not decode: {exc}", path=path) from None
    if not isinstance(snapshot, str):
        raise CorruptCheckpointError(f"{path}: header does not decode: its snapshot is not a string", path=path)
    return snapshot


def _check_header_sum(body: bytes, expected_hash: int, path: str) -> None:
    if xxhash.xxh64_intdigest(body) != expected_hash:
        raise CorruptCheckpointError(f"{path}: header checksum mismatch (the header is corrupt)", path=path)


def check_tag(tag: str) -> str:
    """Tags name files and markers, so they must be one safe path component."""
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise InvalidRequestError(
            f"invalid tag {tag!r}: use 1-{TAG_MAX} characters of letters, digits and ._+=- , not starting with '.' or '-'",
            tag=str(tag)[:256],
        )
    return tag


def marker_name(tag: str) -> str:
    return f"{MARKER_PREFIX}{tag}{MARKER_SUFFIX}"


def is_marker_name(name: str) -> bool:
    """Whether a file (or object) named ``name`` is some tag's commit marker by its name."""
    return name.startswith(MARKER_PREFIX) and name.endswith(MARKER_SUFFIX)


DONE_PREFIX = "datastates-done."


def done_name(tag: str, node_rank: int) -> str:
    """One node's part of a multi-node tag, a CommitMarker of that node's files; never taken as committed."""
    return f"{DONE_PREFIX}{tag}.node{node_rank}{MARKER_SUFFIX}"


TRACKER = "latest"
"""Beside the tag folders: the newest committed tag, as DeepSpeed's ``load_checkpoint`` reads it."""
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron's tracker, holding the iteration number; written for tags named ``iter_<N>``."""


@dataclass(frozen=True)
class MarkerFile:
    path: str
    size: int
    snapshot: str = ""
    """The snapshot the file must hold (``FileHeader.snapshot``); "" in markers written before it existed."""

    def holds(self, snapshot: str, size: int | None = None) -> bool:
        """Whether a file holding ``snapshot`` (and ``size`` bytes; None: not asked) is the one listed: its snapshot,
        or, where the marker lists none (an older marker), its size. The one rule of "is this file committed?"."""
        if self.snapshot:
            return self.snapshot == snapshot
        return size is None or self.size == size


@dataclass(frozen=True)
class CommitMarker:
    """Written, fsynced and renamed into place last: its presence is what "committed" means."""

    version: int
    tag: str
    committed_ns: int
    files: list[MarkerFile]
    requested_ns: int = 0
    """When the commit was asked for. Tags committed concurrently finish in any order, so
    this, not ``committed_ns``, says which is newest: the one the training loop asked for last."""
    nodes: int = 1
    """How many nodes the job that committed the tag ran on."""
    node: int = -1
    """-1: the marker lists every node's files. Else, on a tier only one node sees, the one node whose files it lists."""
    sequence: int = 0
    """The tag's place in its run's commit order: 1 + the highest sequence committed in the run
    (the folder holding the tag's folder) when the commit was asked for. The job's own order,
    not a clock: a node whose clock runs ahead or steps back changes nothing. 0 in markers
    written before it existed, so every newer commit sorts after them."""
    job: str = ""
    """A done marker's job attempt (``Ranks.job``): node 0 commits a tag only with done markers of its own attempt."""
    began_ns: int = 0
    """A done marker's attempt start: when the first of its node's ranks started its process (0: unknown)."""
    owner: str = ""
    """A done marker's writer (the daemon's owner tag, daemon/instances.py): a later daemon of that node removes it
    once the writer is dead, since no rank of the writer's is left to be told the tag committed."""

    @property
    def newness(self) -> tuple[int, int, int]:
        """The key ``latest()``, the trackers and retention order tags by: the sequence first, clocks only to break ties."""
        return (self.sequence, self.requested_ns, self.committed_ns)

    def encode(self) -> bytes:
        return json.dumps(self, default=plain, indent=1).encode()

    @classmethod
    def decode(cls, raw: bytes) -> CommitMarker:
        marker = from_dict(cls, json.loads(raw))
        if marker.version != COMMIT_VERSION:
            raise UnsupportedFormatError(f"commit marker version {marker.version} is not supported")
        return marker

    @classmethod
    def read(cls, path: str) -> CommitMarker | None:
        """The marker at ``path``, or None if it is absent, not yet renamed into place, or not a marker
        (a FIFO or a device named like one is never opened to wait: ``read_regular``)."""
        try:
            return cls.decode(read_regular(path))
        except (OSError, ValueError, DatastatesError):
            return None
