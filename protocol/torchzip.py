"""The zip container ``torch.save`` writes, laid out for O_DIRECT streaming: the container of checkpoint formats 2 and 3.

``torch.load`` reads an uncompressed zip: ``<archive>/data.pkl`` (the skeleton, pickled with
persistent ids that name storage records), one ``<archive>/data/<key>`` record per
storage, and a few small records. It locates records through the central directory at the
end, checks that the file begins with a local header, and never verifies a CRC-32. So a
file can be planned before a byte of tensor data is copied: every record's size is known,
each local header (CRC 0, as ``torch.serialization.set_crc32_options(False)`` writes) can be
written into the padding before its record, each record's data can start on a 4 KiB
boundary for O_DIRECT, and the central directory goes last. Sizes of 4 GiB or more take
zip64 fields, which torch's reader (miniz) and Python's ``zipfile`` both read.

``plan_zip`` places the records; ``local_header`` and ``central_directory`` are the bytes
to write around them. ``data_pkl`` makes ``data.pkl`` from the skeleton, each tensor entry's
persistent id replaced by the opcodes its provider's torch-free half writes (protocol/tensormeta.py).
"""

from __future__ import annotations

import pickletools
import struct
from dataclasses import dataclass
from typing import Sequence

from . import tensormeta
from .descriptors import EntryDesc
from .errors import InvalidRequestError

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_EXTRA = struct.Struct("<HH")
_ZIP64_ID = 0x0001
_PAD_ID = 0x4246
"""The extra field ``torch.save`` pads records with ("FB"): readers skip extra fields they do not know."""
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_UTF8 = 0x0800
"""General-purpose flag bit 11: names are UTF-8."""
_DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1
"""1980-01-01, the earliest date a zip can hold: a checkpoint's time lives in its index, not here."""


@dataclass(frozen=True)
class Record:
    name: str
    """The full name in the archive, ``<archive>/data/3`` say."""
    size: int
    header_offset: int
    """Where its local header starts."""
    data_offset: int
    """Where its bytes start: the local header ends exactly here."""

    def zip64(self) -> bool:
        return self.size >= _U32 or self.header_offset >= _U32


def _header_len(name: bytes, size: int) -> int:
    return _LOCAL.size + len(name) + (_EXTRA.size + 16 if size >= _U32 else 0)


def local_header_size(name: str) -> int:
    """Bytes of the local header of a record named ``name`` under 4 GiB with no padding: where its data starts."""
    return _header_len(name.encode(), 0)


def plan_zip(records: list[tuple[str, int, int, int]], start: int = 0) -> tuple[list[Record], int]:
    """Place ``records`` (name, size, alignment of its data, phase: the data starts ``phase`` bytes past a
    multiple of the alignment) one after the other from ``start``; the records and where the central directory
    starts. Each local header ends exactly where its data begins: the gap before it is filled by a padding
    extra field of at least 4 bytes."""
    out, at = [], start
    for name, size, align, phase in records:
        raw = name.encode()
        if len(raw) > _U16:
            raise ValueError(f"zip record name of {len(raw)} bytes")
        bare = at + _header_len(raw, size)
        data = bare + (phase - bare) % align
        if 0 < data - bare < _EXTRA.size:  # a padding field cannot be shorter than its own header
            data += align
        out.append(Record(name, size, at, data))
        at = data + size
    return out, at


def _padding(record: Record) -> bytes:
    gap = record.data_offset - record.header_offset - _header_len(record.name.encode(), record.size)
    return _EXTRA.pack(_PAD_ID, gap - _EXTRA.size) + bytes(gap - _EXTRA.size) if gap else b""


def local_header(record: Record) -> bytes:
    """The bytes from ``record.header_offset`` to ``record.data_offset``."""
    name = record.name.encode()
    big = record.size >= _U32
    extra = (_EXTRA.pack(_ZIP64_ID, 16) + struct.pack("<QQ", record.size, record.size) if big else b"") + _padding(record)
    size32 = _U32 if big else record.size
    head = _LOCAL.pack(0x04034B50, 45 if big else 20, _UTF8, 0, 0, _DOS_DATE, 0, size32, size32, len(name), len(extra))
    return head + name + extra


def central_directory(records: list[Record], at: int, crcs: dict[str, int] | None = None) -> bytes:
    """The central directory and end records, to be written at ``at`` (the end of the last record); the
    file ends with them. ``crcs``: a CRC-32 per record name where known, else 0."""
    crcs = crcs or {}
    body = bytearray()
    for r in records:
        name = r.name.encode()
        fields = [r.size, r.size] if r.size >= _U32 else []
        fields += [r.header_offset] if r.header_offset >= _U32 else []
        extra = _EXTRA.pack(_ZIP64_ID, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) if fields else b""
        size32 = _U32 if r.size >= _U32 else r.size
        body += _CENTRAL.pack(0x02014B50, 45, 45 if r.zip64() else 20, _UTF8, 0, 0, _DOS_DATE, crcs.get(r.name, 0),
                              size32, size32, len(name), len(extra), 0, 0, 0, 0, min(r.header_offset, _U32))
        body += name + extra
    n, size = len(records), len(body)
    if n >= _U16 or at >= _U32 or size >= _U32:
        body += _EOCD64.pack(0x06064B50, _EOCD64.size - 12, 45, 45, 0, 0, n, n, size, at)
        body += _LOCATOR64.pack(0x07064B50, 0, at + size, 1)
        body += _EOCD.pack(0x06054B50, 0, 0, min(n, _U16), min(n, _U16), min(size, _U32), min(at, _U32), 0)
    else:
        body += _EOCD.pack(0x06054B50, 0, 0, n, n, size, at, 0)
    return bytes(body)


_INT_PUSH = {"BININT1", "BININT2", "BININT", "LONG1"}
PICKLE_PROTOCOL = 2
"""The pickle protocol of every skeleton, as torch.save's: ``data.pkl`` is the skeleton with its persistent ids
replaced by longer opcodes, which holds only where no opcode counts the bytes or memo slots that follow it."""
_UNSPLICEABLE = {"FRAME": "frames count their bytes", "MEMOIZE": "it numbers memo slots implicitly",
                 "PERSID": "its persistent ids are text"}
"""The opcodes (of protocols 0 and 4+) that splicing would break, with why: torch.load would misread data.pkl."""


def data_pkl(entries: Sequence[EntryDesc], root: int, storage_sizes: Sequence[int]) -> bytes:
    """The ``data.pkl`` of a file whose index holds ``entries`` (tensor ones checked by ``check_view``), ``root`` and
    storages of ``storage_sizes`` bytes; b"" if it has none (the skeleton names a leaf that is not a tensor, so
    ``datastates.load`` alone reads the file). The daemon writes it; ``verify`` and ``datastates.load`` rebuild it
    and compare, which proves ``torch.load`` rebuilds what ``datastates.load`` does. Raises InvalidRequestError
    for a skeleton no ``data.pkl`` can be made from."""
    skeleton = entries[root]
    if skeleton.provider != "pickle" or not isinstance(skeleton.meta.get("data"), bytes):
        return b""
    tensors = {i: e.meta for i, e in enumerate(entries) if e.provider == tensormeta.NAME}
    try:
        return torch_data_pkl(skeleton.meta["data"], tensors, storage_sizes) or b""
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"the skeleton {exc.message}") from None


def torch_data_pkl(skeleton: bytes, tensors: dict[int, dict], storage_sizes: Sequence[int]) -> bytes | None:
    """The ``data.pkl`` ``torch.load`` reads, made from a datastates skeleton without running it.

    ``skeleton`` is the client's pickle of the state, each leaf replaced by a persistent id:
    its entry's index (``<int> BINPERSID``). ``tensors`` has, for each tensor entry, its
    provider's metadata; ``storage_sizes``, each storage's size. Each ``<int> BINPERSID`` becomes
    the opcodes ``torch.save`` writes for that tensor, naming its storage as record
    ``data/<storage index>``; the first one is memoized, so one object in is one object out
    again. None if the skeleton names an entry that is not a tensor; InvalidRequestError (its
    message says what is wrong, after "the skeleton") if it is not a protocol-2 pickle with int ids.
    """
    persids, next_memo = _scan(skeleton)
    if next_memo + len(persids) > 0xFFFFFFFF:
        raise InvalidRequestError(f"uses memo slots up to {next_memo}, beyond what LONG_BINPUT can name")
    seen: dict[int, int] = {}
    typed = tensormeta.typed_storages(tensors, storage_sizes)
    out, copied = bytearray(), 0
    for start, end, index in persids:
        out += skeleton[copied:start]
        copied = end
        if index in seen:
            out += b"j" + struct.pack("<I", seen[index])
            continue
        meta = tensors.get(index)
        if meta is None:
            return None
        out += tensormeta.pickled_tensor(meta, storage_sizes[meta["storage"]], meta["storage"] in typed)
        seen[index] = next_memo
        out += b"r" + struct.pack("<I", next_memo)
        next_memo += 1
    return bytes(out + skeleton[copied:])


def _scan(skeleton: bytes) -> tuple[list[tuple[int, int, int]], int]:
    """One pass over the opcodes (streamed: millions of them make no list): each ``<int> BINPERSID`` as
    (start, end, entry index), and the first memo index unused. Raises InvalidRequestError for a pickle that
    is not of PICKLE_PROTOCOL, does not parse, or has a persistent id that is not an int."""
    persids: list[tuple[int, int, int]] = []
    memo = -1
    prev: tuple = (None, None, 0)
    try:
        for op, arg, pos in pickletools.genops(skeleton):
            if pos == 0 and (op.name != "PROTO" or arg != PICKLE_PROTOCOL):
                found = f"protocol {arg}" if op.name == "PROTO" else "protocol 0 or 1 (no PROTO opcode)"
                raise InvalidRequestError(f"is a pickle of {found}: a skeleton must be of protocol {PICKLE_PROTOCOL}, "
                                          "as torch.save writes, for torch.load to read the file")
            if op.name in _UNSPLICEABLE:
                raise InvalidRequestError(f"has opcode {op.name} at byte {pos}, which a protocol-{PICKLE_PROTOCOL} "
                                          f"skeleton cannot have ({_UNSPLICEABLE[op.name]})")
            if op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
                memo = max(memo, int(arg))
            elif op.name == "BINPERSID":
                if prev[0] is None or prev[0].name not in _INT_PUSH:
                    raise InvalidRequestError(f"has a persistent id at byte {pos} that is not an int (an entry's index)")
                persids.append((prev[2], pos + 1, prev[1]))
            prev = (op, arg, pos)
    except InvalidRequestError:
        raise
    except Exception as exc:  # genops raises ValueError, or anything its parsing of args meets
        raise InvalidRequestError(f"is not a valid pickle: {type(exc).__name__}: {str(exc)[:200]}") from None
    return persids, memo + 1
