"""Every wire message, defined once.

Frame layout (DEALER side): ``[header, body]``, both msgpack maps. The ROUTER side sees the
peer identity in front. The header carries the protocol version, the message type, the
message id and, on replies, the id of the request it answers (as Jupyter's parent_header).
A reply to a request is either the request's own reply type or ERROR.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from .descriptors import EntryDesc, Fence, Ranks, SourceDesc, Tier
from .errors import DatastatesError, ProtocolError, UnknownMessageError, VersionMismatchError
from .schema import Decoded, from_dict, list_fields, pack
from .version import PROTOCOL_VERSION

MAX_FRAME_BYTES = 256 << 20
"""A frame larger than this is refused before it is decoded (skeletons are far smaller)."""


class MsgType(enum.StrEnum):
    HELLO = "hello"
    WELCOME = "welcome"
    SNAPSHOT = "snapshot"
    SNAPSHOT_ACK = "snapshot_ack"
    WAIT = "wait"
    WAIT_DONE = "wait_done"
    COMMIT = "commit"
    COMMITTED = "committed"
    STATUS = "status"
    STATUS_REPLY = "status_reply"
    SHUTDOWN = "shutdown"
    SHUTDOWN_ACK = "shutdown_ack"
    BYE = "bye"
    BYE_ACK = "bye_ack"
    HEARTBEAT = "heartbeat"
    HEARTBEAT_ACK = "heartbeat_ack"
    RESTORE = "restore"
    RESTORE_REPLY = "restore_reply"
    CUDA_PROBE = "cuda_probe"
    CUDA_PROBE_REPLY = "cuda_probe_reply"
    ERROR = "error"


@dataclass(frozen=True)
class Header:
    version: int
    type: str
    id: int
    parent: int | None = None


class Body:
    """Base of message bodies; ``TYPE`` ties a body class to its message type."""

    TYPE: ClassVar[MsgType]


@dataclass(frozen=True)
class Hello(Body):
    TYPE = MsgType.HELLO
    pid: int
    name: str
    host: str = ""
    on_busy: str = "block"
    """What the daemon does with a new tag's snapshot while an older tag's is still pending: see ON_BUSY."""
    pidns: int = 0
    """Inode of the client's pid namespace: a daemon in the same one watches ``pid`` itself, not heartbeats."""
    started: str = ""
    """The client's start time as its own /proc says: where namespaces cannot be read, a daemon that reads the
    same for ``pid`` watches it (protocol/liveness.py ``shares_pids``)."""
    ranks: Ranks = field(default_factory=Ranks)
    began_ns: int = 0
    """When the client's process started (wall clock, ns; 0: unknown): the start of its job's attempt, before which
    no other node's part of a tag of the attempt can have been written (daemon/gather.py)."""
    decisions: str = ""
    """The client's folder of per-snapshot decisions (protocol/outcome.py); "" for a client that never gives up."""
    probe: str = ""
    """``<address hex>:<bytes hex>``, bytes the client keeps at that address: a daemon that reads them back
    there reads the client's CPU memory in place (daemon/sources/vm.py); "" to use shared memory."""


ON_BUSY = ("block", "skip")


@dataclass(frozen=True)
class Welcome(Body):
    TYPE = MsgType.WELCOME
    client_id: str
    daemon_pid: int
    roots: list[str] = field(default_factory=list)
    heartbeat_s: float = 0.0
    """How often the client should show it is alive when it has nothing else to send (0: never)."""
    tiers: list[Tier] = field(default_factory=list)
    """The storage tiers, fastest first (empty: none)."""
    vm_refused: str = "not probed"
    """Why the daemon cannot read this client's CPU memory in place ("" when it can): then the client
    shares its CPU tensors through /dev/shm instead."""


@dataclass(frozen=True)
class Snapshot(Body):
    TYPE = MsgType.SNAPSHOT
    path: str
    tag: str
    sources: list[SourceDesc]
    entries: list[EntryDesc]
    root: int
    ticket: str = ""
    """This snapshot's name in the client's decision folder: the daemon claims it ``copied`` before answering WAIT."""
    fences: list[Fence] = field(default_factory=list)
    """One per GPU the CUDA sources lie on (empty without any)."""
    retired: list[str] = field(default_factory=list)
    """CUDA handles of earlier snapshots whose storages the trainer has freed since: the daemon drops its
    mappings of them, which lets the trainer's allocator reuse their blocks (daemon/sources/cuda.py)."""


@dataclass(frozen=True)
class SnapshotAck(Body):
    TYPE = MsgType.SNAPSHOT_ACK
    snapshot_id: int
    total_bytes: int
    skipped: str = ""
    """Why the daemon skipped this snapshot (``on_busy: skip``); empty when it was admitted."""


@dataclass(frozen=True)
class Wait(Body):
    """Answered once the daemon holds its own copy of the listed snapshots (all if empty)."""

    TYPE = MsgType.WAIT
    snapshot_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class WaitDone(Body):
    TYPE = MsgType.WAIT_DONE
    snapshot_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Commit(Body):
    TYPE = MsgType.COMMIT
    tag: str
    lost: str = ""
    """Why part of the tag went with a daemon the client lost, "" if none did: the daemon then commits none of it
    (this client's snapshots of it are dropped, its other ranks' commits fail), as for a refused snapshot."""


@dataclass(frozen=True)
class Committed(Body):
    TYPE = MsgType.COMMITTED
    tag: str
    marker: str
    files: list[str]


@dataclass(frozen=True)
class Restore(Body):
    """Where the daemon's replica (its file in /dev/shm) of ``path`` is, if it holds one of ``tag`` with ``size`` bytes
    holding ``snapshot``, the snapshot the tag's marker lists for the file ("" from an older client: none serves)."""

    TYPE = MsgType.RESTORE
    path: str
    tag: str
    size: int
    snapshot: str = ""


@dataclass(frozen=True)
class RestoreReply(Body):
    TYPE = MsgType.RESTORE_REPLY
    replica: str
    """A checkpoint file in the daemon's /dev/shm folder, or "" when it holds no such replica."""
    why_not: str = ""


@dataclass(frozen=True)
class Status(Body):
    TYPE = MsgType.STATUS


@dataclass(frozen=True)
class StatusReply(Body):
    TYPE = MsgType.STATUS_REPLY
    status: dict[str, Any]


@dataclass(frozen=True)
class Shutdown(Body):
    TYPE = MsgType.SHUTDOWN


@dataclass(frozen=True)
class ShutdownAck(Body):
    TYPE = MsgType.SHUTDOWN_ACK


@dataclass(frozen=True)
class Bye(Body):
    TYPE = MsgType.BYE


@dataclass(frozen=True)
class ByeAck(Body):
    TYPE = MsgType.BYE_ACK


@dataclass(frozen=True)
class CudaProbe(Body):
    """Can the daemon open this client's CUDA IPC handles on this device? Asked once per device, before the
    first snapshot there, with the handle of a small tensor: the answer decides between CUDA IPC and the
    client copying device to host itself (``gpu_capture``)."""

    TYPE = MsgType.CUDA_PROBE
    handle: str
    expect: bytes
    """The tensor's bytes: the daemon reads them back through the handle, as a copy would."""


@dataclass(frozen=True)
class CudaProbeReply(Body):
    TYPE = MsgType.CUDA_PROBE_REPLY
    refused: str = ""
    """Why the daemon cannot open the handle ("" when it opened it and read it back)."""


@dataclass(frozen=True)
class Heartbeat(Body):
    """A sign of life: the client's when idle, so the daemon can tell a vanished trainer; the daemon's reply, when probed."""

    TYPE = MsgType.HEARTBEAT


@dataclass(frozen=True)
class HeartbeatAck(Body):
    TYPE = MsgType.HEARTBEAT_ACK


@dataclass(frozen=True)
class Error(Body):
    TYPE = MsgType.ERROR
    code: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, exc: DatastatesError) -> Error:
        detail = {k: v for k, v in exc.detail.items() if isinstance(v, (str, int, float, bool))}
        return cls(code=exc.code, message=exc.message, detail=detail)


BODIES: dict[str, type[Body]] = {c.TYPE.value: c for c in Body.__subclasses__()}


def encode(body: Body, msg_id: int, parent: int | None = None) -> list[bytes]:
    """The ``[header, body]`` frames of one message."""
    header = Header(version=PROTOCOL_VERSION, type=body.TYPE.value, id=msg_id, parent=parent)
    return [
        pack(header),
        pack(body),
    ]


def _unpack(frame: bytes, what: str) -> Any:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"{what} frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES)
    except Exception as exc:  # msgpack raises many unrelated types for bad input
        raise ProtocolError(f"{what} is not valid msgpack: {exc}") from None


def decode_header(frames: list[bytes]) -> Header:
    """The header of ``[header, body]``, whatever its version (see ``check_version``).

    The header layout and the ERROR body never change between versions, so a peer of
    another version can always be told, in a reply it can read, why it is refused.
    """
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames [header, body], got {len(frames)}")
    return from_dict(Header, _unpack(frames[0], "header"), "header")


def check_version(header: Header) -> None:
    if header.version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version {header.version} is not supported; this side speaks "
            f"version {PROTOCOL_VERSION}: install matching datastates versions on client and daemon",
            peer_version=header.version,
            version=PROTOCOL_VERSION,
        )


def decode_body(header: Header, frame: bytes) -> Body:
    cls = BODIES.get(header.type)
    if cls is None:
        raise UnknownMessageError(f"unknown message type {header.type!r}", type=str(header.type)[:64])
    data, long = _unpack_fields(cls, frame)
    body = from_dict(cls, data, header.type)
    _keep(cls, body, long)
    return body


KEEP_MIN_BYTES = 64 << 10
"""A body's list field encoded in this many bytes or more is kept, decoded, with its bytes (``_kept``)."""
KEEP_BYTES = 32 << 20
"""Encoded bytes of the fields kept, at most; a longer field is never kept. The decoded values take several times
as much. 100,000 tensors' entries and sources are 17.7 MB: a node of 8 such ranks decodes each time."""
_kept: collections.OrderedDict[tuple[type, str, bytes], Any] = collections.OrderedDict()
"""The long fields decoded lately, by (body class, field, encoded bytes), oldest first. A trainer sends the same
entries, and mostly the same sources, with every checkpoint: for 100,000 tensors, decoding them took a third of the
time between its ``snapshot()`` and its ``wait()``, and the planner knows the state's layout again by the decoded
list's identity (protocol/layout.py). A value given again is shared: nothing may change it. The value is a function
of its bytes alone, so one client's is another's (a handle means what the client it comes from means by it)."""
_kept_bytes = 0
_kept_lock = threading.Lock()


def _unpack_fields(cls: type, frame: bytes) -> tuple[Any, dict[str, bytes]]:
    """The body's map, each long field that came in a recent body byte for byte given as its decoded value
    (``Decoded``); and the long fields decoded anew, by name, with their bytes. A body that is not a map of distinct
    field names (not msgpack, a duplicate key: whose value would be kept under the other's bytes) is unpacked whole,
    as a short one is, and keeps nothing."""
    if len(frame) < KEEP_MIN_BYTES:
        return _unpack(frame, "body"), {}
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"body frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    names = {f.name for f in dataclasses.fields(cls)}
    lists = list_fields(cls)
    reader = msgpack.Unpacker(raw=False, strict_map_key=True, max_buffer_size=MAX_FRAME_BYTES,
                              max_bin_len=MAX_FRAME_BYTES)
    reader.feed(frame)
    data: dict[Any, Any] = {}
    long: dict[str, bytes] = {}
    try:
        for _ in range(reader.read_map_header()):
            key = reader.unpack()
            if key in data or key not in names:
                raise ValueError("not a map of distinct field names")
            start = reader.tell()
            reader.skip()
            raw = frame[start:reader.tell()]
            if not KEEP_MIN_BYTES <= len(raw) <= KEEP_BYTES or key not in lists:
                data[key] = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES)
                continue
            with _kept_lock:
                value = _kept.get((cls, key, raw), _kept)
                if value is not _kept:
                    _kept.move_to_end((cls, key, raw))
                    data[key] = Decoded(value)
                    continue
            data[key] = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES)
            long[key] = raw
        if reader.tell() != len(frame):
            raise ValueError("extra data after the body")
    except Exception:  # not valid msgpack, or not a map of distinct field names: as for a short body
        return _unpack(frame, "body"), {}
    return data, long


def _keep(cls: type, body: Body, long: dict[str, bytes]) -> None:
    global _kept_bytes
    with _kept_lock:
        for key, raw in long.items():
            if (cls, key, raw) not in _kept:
                _kept[(cls, key, raw)] = getattr(body, key)
                _kept_bytes += len(raw)
        while _kept_bytes > KEEP_BYTES:
            (_, _, raw), _ = _kept.popitem(last=False)
            _kept_bytes -= len(raw)
