"""The object store backend (S3 and its API's other servers): addresses, the client, reading, and writing.

A tier or a checkpoint path may be ``s3://bucket/prefix``: a tag lies at
``<prefix>/<run>/<tag>/<file>``, the layout of a file tier, with its commit marker object
written last. The daemon writes there (``S3Storage``, its parts uploaded by the upload
process: daemon/uploader.py); the client reads (``latest``, ``load``, ``Client.restore``)
through ``ObjectFile``.

The client is botocore's (boto3), chosen by measurement on this machine against a local
S3 server (docs/performance.md): it reads as fast as obstore from the same server, and it
alone lists and aborts multipart uploads, which the clean-up after a killed daemon needs.
Its own chain finds the endpoint, region and credentials: the ``AWS_*`` environment
variables (``AWS_ENDPOINT_URL`` included), profile files, instance metadata. A tier's
``endpoint`` and ``region`` keys override the first two; secrets are never in the node
config. Path-style addressing wherever an endpoint is given (a local server's buckets are
not host names). Retries: botocore's standard mode, exponential backoff with jitter on 5xx,
throttling and dropped connections, ATTEMPTS tries; but a request the server does not answer
(no byte for READ_TIMEOUT_S, or no connection within CONNECT_TIMEOUT_S) is tried TIMEOUT_TRIES
times only, so one to a hung server fails within GIVE_UP_S, naming the object and that bound.
Every uploaded part carries a CRC32 the server checks, so over HTTPS its payload is not also
hashed with SHA-256 for the signature (over plain HTTP botocore always signs it); downloads
are checked against the file's own checksums.

Writing: a file becomes one object by a multipart upload, visible only once complete.
``create`` starts a multipart upload and journals its id beside this daemon's lock
(the ``journals`` folder the daemon gives), ``upload`` has one part (``PART`` bytes of a file at a multiple of
it; the last may be shorter) uploaded by the upload process, with its
CRC32 in a header, which the server checks, in any order, ``finalize`` completes it (the
object appears whole, or not at all), ``abort`` aborts it. An object is uploaded from a committed
file, never written piece by piece by a snapshot: it has no ``write``. ``publish`` is one PUT (markers,
trackers): an object store has no rename, so a marker is written only once every object it
lists is complete, which is what makes it last. A killed daemon's uploads stay open on the
server (and are billed) until the next daemon of this node aborts those its journal names:
no other daemon's upload is ever touched. A bucket lifecycle rule that aborts incomplete
uploads after a day covers a node that never comes back (docs/deploy.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

from ..descriptors import Tier
from ..errors import ConfigError, CorruptCheckpointError, DatastatesError, InvalidRequestError, StorageError
from ..format import TRACKER, CommitMarker, MarkerFile, check_tag, is_marker_name, marker_name
from ..tags import CommittedTag, tag_files, trusted_marker
from .base import Gone, Reads, UploadedStorage, backend_for, register_backend

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEME = "s3://"
ATTEMPTS = 6
"""Tries of one request (botocore's standard retry mode: backoff with jitter, at most 20 s apart)."""
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 15.0
"""A server silent this long on an open request fails that try (S3 sends white space while it completes a large
multipart upload, to keep the connection from timing out)."""
TIMEOUT_TRIES = 2
"""Tries of one request whose tries the server leaves unanswered (a hung server): READ_TIMEOUT_S each."""
GIVE_UP_S = TIMEOUT_TRIES * (READ_TIMEOUT_S + 1)
"""The longest a request to a hung server waits before it fails: its tries, and botocore's backoff between them."""
MARKER_READS = 16
"""Marker objects read at once when a folder of an object store is scanned: half the client's connections."""
READ_STREAMS = 8
"""Ranged GETs of one object at once: a load's threads on an object (a file's are READ_THREADS)."""
POOL = 32
"""Connections per client: the parallel part uploads and ranged reads of every file at once."""
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENDPOINT_RE = re.compile(r"https?://[A-Za-z0-9.\[\]:-]+(:[0-9]{1,5})?/?")
_REGION_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


@dataclass(frozen=True)
class ObjectPath:
    """``s3://bucket/key``: the bucket, and the key with no leading or trailing slash."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, url: str) -> ObjectPath:
        """The address, or ConfigError saying what is wrong with it (a scheme, a bucket name, an odd key)."""
        if not is_object(url):
            scheme = url.split("://", 1)[0] if "://" in url else ""
            raise ConfigError(f"{url!r}: unknown scheme {scheme!r}; an object store address is s3://bucket/prefix")
        bucket, _, key = url[len(SCHEME):].partition("/")
        if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ConfigError(f"{url!r}: {bucket!r} is not a bucket name (3-63 lowercase letters, digits, '.' or '-')")
        key = key.strip("/")
        if any(part in ("", ".", "..") for part in key.split("/")) and key:
            raise ConfigError(f"{url!r}: the key has an empty, '.' or '..' part")
        return cls(bucket, key)

    @property
    def url(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}" if self.key else f"{SCHEME}{self.bucket}"

    def join(self, *parts: str) -> ObjectPath:
        return ObjectPath(self.bucket, "/".join(p.strip("/") for p in (self.key, *parts) if p.strip("/")))

    @property
    def prefix(self) -> str:
        """The key as a folder: what every object below it starts with."""
        return self.key + "/" if self.key else ""


def is_object(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object store address rather than a file system path (a ``Path`` never is one)."""
    return isinstance(path, str) and path.startswith(SCHEME)


_PLACES: dict[str, tuple[str, str]] = {}
"""Tier address → its (endpoint, region) keys: what every address below it is reached through."""


def register(url: str, endpoint: str = "", region: str = "") -> None:
    """Reach the objects below ``url`` (a tier's path) through ``endpoint`` and ``region`` ('': boto3's chain)."""
    _PLACES[url.rstrip("/") + "/"] = (endpoint, region)


def place_for(url: str) -> tuple[str, str]:
    """The endpoint and region ``url`` is reached through: its tier's where registered, else ('', ''): boto3's chain."""
    return next((v for k, v in _PLACES.items() if (url.rstrip("/") + "/").startswith(k)), ("", ""))


def client_for(url: str) -> Any:
    """The client for ``url`` (``place_for``)."""
    return client(*place_for(url))


@functools.lru_cache(maxsize=None)
def client(endpoint: str = "", region: str = "") -> Any:
    """The shared botocore client for this endpoint and region ('': found by boto3's chain); thread-safe."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("an s3:// path needs boto3: pip install 'datastates[s3]'") from None
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    addressing = {"addressing_style": "path"} if endpoint else {}

    def make(s3: dict[str, Any]) -> Any:
        config = Config(retries={"mode": "standard", "max_attempts": ATTEMPTS}, max_pool_connections=POOL,
                        connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S, s3=s3,
                        response_checksum_validation="when_required")
        made = session.client("s3", endpoint_url=endpoint or None, region_name=region or session.region_name
                              or "us-east-1", config=config)
        made.meta.events.register_first("needs-retry.s3", _give_up_unanswered)
        return made

    try:
        session = boto3.session.Session()
        made = make(addressing)
        if made.meta.endpoint_url.lower().startswith("https://"):
            # over TLS, with each part's CRC32 in a header, the payload needs no SHA-256 of its own: what botocore
            # decides itself where it computes the checksum, not where it is given one (``S3Storage``); over
            # plain HTTP (whichever way the endpoint was found) every payload stays signed
            made = make({**addressing, "payload_signing_enabled": False})
        return made
    except Exception as exc:  # a malformed endpoint or region, an unreadable profile: botocore's own words
        raise ConfigError(f"cannot reach an object store at {endpoint or 'AWS'!r}: {exc}") from None


def _give_up_unanswered(attempts: int, caught_exception: BaseException | None = None, **_: Any) -> bool | None:
    """botocore's retry decision, asked before its own: no further try of a request the server left unanswered
    TIMEOUT_TRIES times (False); else None, and botocore decides."""
    return False if _unanswered(caught_exception) and attempts >= TIMEOUT_TRIES else None


def _unanswered(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a try the server did not answer: no connection, or no byte, in time."""
    return type(exc).__name__ in ("ReadTimeoutError", "ConnectTimeoutError")


def check_endpoint(endpoint: str) -> str:
    """Why ``endpoint`` (a tier's key) is no object store server's URL, or "": ``http(s)://host[:port]``."""
    if endpoint and not _ENDPOINT_RE.fullmatch(endpoint):
        return f"{endpoint!r} is not http://HOST[:PORT] or https://HOST[:PORT]"
    return ""


def check_region(region: str) -> str:
    """Why ``region`` (a tier's key) is no region name, or ""."""
    if region and not _REGION_RE.fullmatch(region):
        return f"{region!r} is not a region name (letters, digits and '-', as us-east-1)"
    return ""


_REFUSED = {
    "NoSuchBucket": "the bucket does not exist",
    "AccessDenied": "access denied (a bucket policy, or credentials without the right)",
    "AllAccessDisabled": "access denied (a bucket policy, or credentials without the right)",
    "InvalidAccessKeyId": "the credentials were refused (unknown access key)",
    "SignatureDoesNotMatch": "the credentials were refused (wrong secret key)",
    "ExpiredToken": "the credentials were refused (expired token)",
    "InvalidToken": "the credentials were refused (invalid token)",
    "NoSuchKey": "no such object",
    "404": "no such object",
    "403": "access denied (a bucket policy, or the credentials)",
    "PreconditionFailed": "the object changed while it was being read (another save of the same path)",
    "412": "the object changed while it was being read (another save of the same path)",
    "SlowDown": "the server is throttling requests (still after every retry)",
    "ServiceUnavailable": "the server is unavailable (503, still after every retry)",
    "503": "the server is unavailable (503, still after every retry)",
}


def object_error(what: str, url: str, exc: Exception) -> StorageError:
    """The StorageError for a botocore failure met doing ``what`` to ``url``: its cause in words, never a secret."""
    response = getattr(exc, "response", None)
    code = ""
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", "")) or str(
            response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        cause = _REFUSED.get(code, f"{code}: {response.get('Error', {}).get('Message', '')}".strip(": "))
    elif _unanswered(exc):
        cause = (f"the server did not answer within {READ_TIMEOUT_S:.0f} s, {TIMEOUT_TRIES} tries (about "
                 f"{GIVE_UP_S:.0f} s in all): it hangs, or is unreachable")
    else:
        cause = f"{type(exc).__name__}: {exc}"
    return StorageError(f"{what} {url}: {cause}", path=url, code=code)


def missing(exc: Exception) -> bool:
    """Whether a botocore failure says the object (or upload) is not there."""
    response = getattr(exc, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NoSuchUpload")


def is_client_error(exc: BaseException) -> bool:
    """Whether ``exc`` is botocore's (a refusal, a timeout, a lost connection): what object calls turn into StorageError."""
    return type(exc).__module__.startswith(("botocore", "urllib3", "boto3"))


def read_object(url: str) -> bytes | None:
    """A small object whole (a marker, a tracker), or None if there is none."""
    where = ObjectPath.parse(url)
    try:
        return client_for(url).get_object(Bucket=where.bucket, Key=where.key)["Body"].read()
    except Exception as exc:
        if missing(exc):
            return None
        if is_client_error(exc):
            raise object_error("cannot read", url, exc) from None
        raise


def delete_object(url: str) -> None:
    """Delete one object; one already gone is no error."""
    where = ObjectPath.parse(url)
    try:
        client_for(url).delete_object(Bucket=where.bucket, Key=where.key)
    except Exception as exc:
        if not missing(exc):
            if is_client_error(exc):
                raise object_error("cannot delete", url, exc) from None
            raise


def _listing(url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(url, the listing's entry) of every object below the folder ``url``."""
    where = ObjectPath.parse(url)
    try:
        pages = client_for(url).get_paginator("list_objects_v2").paginate(Bucket=where.bucket, Prefix=where.prefix)
        for page in pages:
            for item in page.get("Contents", []):
                yield f"{SCHEME}{where.bucket}/{item['Key']}", item
    except Exception as exc:
        if is_client_error(exc):
            raise object_error("cannot list", url, exc) from None
        raise


def list_keys(url: str) -> Iterator[tuple[str, int]]:
    """(url, size) of every object below the folder ``url``."""
    for found, item in _listing(url):
        yield found, item["Size"]


def list_etags(url: str) -> dict[str, str]:
    """url → ETag of every object below the folder ``url``: which upload made each."""
    return {found: item.get("ETag", "") for found, item in _listing(url)}


HEAD_BYTES = 1 << 20
"""The object's first bytes, kept from its first GET: a checkpoint's index, header and zip head are read in a few
small reads, each a round trip (and, on some servers, a read of the whole object) of its own otherwise."""
TAIL_BYTES = 1 << 20
"""The object's last bytes, kept from a GET beside the first (a whole read's only): the zip directory and the data
region's last small piece, read at open rather than one request each later."""
WHOLE_AHEAD = 64 << 20
"""How far a whole read's first GET reads on past the head: the data region's first piece (client/filecheck.py's
READ_PIECE), so that piece costs no request of its own."""
_SHARED: contextvars.ContextVar[tuple[dict[str, ObjectFile], bool] | None] = contextvars.ContextVar(
    "datastates_objects", default=None)


@contextlib.contextmanager
def one_read(whole: bool = False) -> Iterator[None]:
    """Within it, ``ObjectFile.open`` of one address is one ObjectFile: the reads of one load share one ETag (so every
    read is of the same object) and one read of its head. ``whole``: the load reads the data region (not only the
    header, nor a few slices): the first GET reads on into it, and the tail is read beside it."""
    opened: dict[str, ObjectFile] = {}
    token = _SHARED.set((opened, whole))
    try:
        yield
    finally:
        _SHARED.reset(token)
        for f in opened.values():
            f.let_go()


def _views(buffers: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """Bytes ``start..stop`` of the buffers laid end to end, as views of them."""
    out: list[memoryview] = []
    pos = 0
    for buf in buffers:
        view = buf.cast("B")
        lo, hi = max(start - pos, 0), min(stop - pos, len(view))
        if lo < hi:
            out.append(view[lo:hi])
        pos += len(view)
        if pos >= stop:
            break
    return out


def _result(future: Future | None) -> Any:
    """A finished future's result, or None where it failed (its error is another's consequence)."""
    try:
        return future.result() if future is not None else None
    except Exception:  # noqa: BLE001
        return None


def _copy_in(buffers: list[memoryview], data: memoryview) -> None:
    for view in buffers:
        view[:] = data[:len(view)]
        data = data[len(view):]


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass
class _Reply:
    """A GET's answer: its body (read on by ``readinto``), the object's ETag and size, the bytes ``start..end`` it holds."""

    body: Any
    etag: str
    size: int
    start: int
    end: int


class ObjectFile:
    """A committed object read by ranges, as a file by ``os.preadv``: the bytes read straight into the caller's
    buffers. Every GET after the first asks for the ETag seen there: an object replaced meanwhile fails the read
    rather than mix two saves' bytes.

    Requests: the first GET reads the head (and, for a whole read, on into the first piece of data, with the tail
    read at once beside it); each later read is served from those, or goes on reading a response an earlier read
    left where this one starts, or is one ranged GET reaching as far as its caller says it will read on. So a whole
    load of a 256 MiB file costs a GET per 64 MiB piece and one for the tail, about what the client's own best
    ranged download makes, and its first two run at once.
    """

    @classmethod
    def open(cls, url: str) -> ObjectFile:
        """The object at ``url``: the one opened already within ``one_read``, else a new one."""
        shared = _SHARED.get()
        if shared is None:
            return cls(url)
        opened, whole = shared
        if url not in opened:
            opened[url] = cls(url, whole, shared=True)
        return opened[url]

    direct = mapped = False
    streams = READ_STREAMS

    def __init__(self, url: str, whole: bool = False, shared: bool = False) -> None:
        self.url = self.path = url
        self._shared = shared
        """Opened within ``one_read``, which lets go of it: ``close`` leaves its responses open for the next reader."""
        self._where = ObjectPath.parse(url)
        self._client = client_for(url)
        self._lock = threading.Lock()
        self._parked: dict[int, tuple[Any, int]] = {}
        """Responses an earlier read left open: by the byte they are at, the body and where it ends."""
        self._etag = ""
        self.size = 0
        self._head = self._tail = b""
        self._tail_at = 0
        for _ in range(2):  # an object replaced between the two first GETs is opened again, once
            if self._open(whole):
                return
        raise StorageError(f"cannot read {url}: {_REFUSED['412']}", path=url)

    def _open(self, whole: bool) -> bool:
        """The first GET (and the tail's beside it); False if the two met two versions of the object."""
        with ThreadPoolExecutor(1) as pool:
            tail = pool.submit(self._request, f"bytes=-{TAIL_BYTES}", "", -1) if whole else None
            first = last = None
            try:
                first = self._request(f"bytes=0-{HEAD_BYTES + (WHOLE_AHEAD if whole else 0) - 1}", "", 0)
                last = tail.result() if tail is not None else None
            except BaseException:
                for reply in (first, _result(tail)):
                    if reply is not None:
                        reply.body.close()
                raise
        if first is None:  # an empty object: no range of it can be asked for
            if last is not None:
                last.body.close()
            try:
                self._etag = self._client.head_object(Bucket=self._where.bucket, Key=self._where.key).get("ETag", "")
            except Exception as exc:
                raise self._failed(exc) from None
            return bool(self._etag) or self._no_etag()
        try:
            if last is not None and (last.etag != first.etag or last.size != first.size):
                first.body.close()
                return False  # replaced between the two: opened again
            self._etag, self.size = first.etag, first.size
            head = bytearray(min(self.size, HEAD_BYTES))
            self._read_into(first.body, [memoryview(head)], 0)
            if last is not None:
                tail_bytes = bytearray(last.end - last.start)
                self._read_into(last.body, [memoryview(tail_bytes)], last.start)
                self._tail, self._tail_at = bytes(tail_bytes), last.start
        except BaseException:
            first.body.close()
            raise
        finally:
            if last is not None:
                last.body.close()
        self._head = bytes(head)
        self._park(first.body, len(head), first.end)
        return bool(self._etag) or self._no_etag()

    def _no_etag(self) -> bool:
        self.let_go()
        raise StorageError(f"cannot read {self.url}: the server names no ETag for it, so its reads cannot be pinned "
                           "to one version of it", path=self.url)

    def _request(self, span: str, etag: str, start: int) -> _Reply | None:
        """GET ``Range: span``, bytes from ``start`` on (-1: the object's last bytes), of version ``etag`` where given;
        None for an empty object. A reply of other bytes than asked for (a server that ignores Range) is refused."""
        try:
            reply = self._client.get_object(Bucket=self._where.bucket, Key=self._where.key, Range=span,
                                            **({"IfMatch": etag} if etag else {}))
        except Exception as exc:
            response = getattr(exc, "response", None)
            if isinstance(response, dict) and response.get("Error", {}).get("Code") == "InvalidRange" and not etag:
                return None  # the first GETs of an empty object
            raise self._failed(exc) from None
        got = _CONTENT_RANGE.fullmatch(str(reply.get("ContentRange", "")))
        first, end, size = (int(got[1]), int(got[2]) + 1, int(got[3])) if got else (0, *[int(reply["ContentLength"])] * 2)
        if first != start if start >= 0 else (end != size or end - first > TAIL_BYTES):
            reply["Body"].close()
            raise StorageError(f"cannot read {self.url}: the server answered a ranged GET ({span}) with bytes "
                               f"{first}..{end} of {size}: it does not serve ranges", path=self.url)
        return _Reply(reply["Body"], reply.get("ETag", ""), size, first, end)

    def _failed(self, exc: Exception) -> Exception:
        if missing(exc):
            return FileNotFoundError(2, "no such object", self.url)
        if is_client_error(exc):
            return object_error("cannot read", self.url, exc)
        return exc

    def _read_into(self, body: Any, buffers: list[memoryview], at: int) -> None:
        got = 0
        try:
            for view in buffers:
                while len(view):
                    n = body.readinto(view)
                    if not n:
                        raise CorruptCheckpointError(f"{self.url}: the object ended at byte {at + got}", path=self.url)
                    got += n
                    view = view[n:]
        except BaseException as exc:
            body.close()
            raise self._failed(exc) if isinstance(exc, Exception) else exc from None

    def _park(self, body: Any, at: int, end: int) -> None:
        """Keep ``body`` (at byte ``at``, ending at ``end``) for the read that starts there; close it if none can."""
        if at >= end:
            body.close()
            return
        with self._lock:
            old = self._parked.pop(at, None)
            self._parked[at] = (body, end)
        if old is not None:
            old[0].close()

    def pread(self, length: int, at: int) -> bytes:
        buf = bytearray(max(0, min(length, self.size - at)))
        self.preadv([memoryview(buf)], at)
        return bytes(buf)

    def preadv(self, buffers: list[memoryview], at: int, until: int = 0) -> int:
        """Fill ``buffers`` in order from byte ``at``; the bytes read (short only at the object's end). ``until``:
        where this caller's reads go on to, one after another: a new GET asks for that much."""
        total = min(sum(b.nbytes for b in buffers), self.size - at)
        if total <= 0:
            return 0
        lo, hi = at, at + total
        if lo < len(self._head):
            upto = min(hi, len(self._head))
            _copy_in(_views(buffers, 0, upto - at), memoryview(self._head)[lo:upto])
            lo = upto
        if self._tail and hi > self._tail_at and hi > lo:
            start = max(lo, self._tail_at)
            tail = memoryview(self._tail)[start - self._tail_at:hi - self._tail_at]
            _copy_in(_views(buffers, start - at, total), tail)
            hi = start
        if lo < hi:
            with self._lock:
                body, end = self._parked.pop(lo, (None, 0))
            if body is not None and end < hi:
                body.close()
                body = None
            if body is None:
                stop = min(self.size, max(hi, until), self._tail_at if self._tail else self.size)
                reply = self._request(f"bytes={lo}-{stop - 1}", self._etag, lo)
                assert reply is not None  # only the first GETs meet an empty object
                body, end = reply.body, reply.end
            self._read_into(body, _views(buffers, lo - at, hi - at), lo)
            self._park(body, hi, end)
        return total

    def close(self) -> None:
        """Done reading: the responses left open are let go, unless ``one_read`` shares this object (it lets go)."""
        if not self._shared:
            self.let_go()

    def let_go(self) -> None:
        """Let go of the responses left open (read on, not needed)."""
        with self._lock:
            parked, self._parked = list(self._parked.values()), {}
        for body, _ in parked:
            body.close()


PART = 16 << 20
"""Bytes of one uploaded part (the last of a file may be shorter): a tier transfer's piece."""
MAX_PARTS = 10_000
"""The most parts of one upload (the S3 limit): a file of 160 GiB at most."""
JOURNAL_SUFFIX = ".uploads"
TRIM_LINES = 64
"""A journal longer than this, and than twice the uploads still open, is written again with the open ones alone: a
daemon that runs for weeks keeps a journal of a few KiB in /dev/shm, not a line per upload it ever made."""


def journal_path(journals: str, owner: str) -> str:
    """Where the daemon ``owner`` notes the multipart uploads it starts: one line each, bucket, key and upload id."""
    return os.path.join(journals, owner + JOURNAL_SUFFIX)


def _line(bucket: str, upload_id: str) -> str:
    """One upload's journal line: not its key, which may hold any character."""
    return f"{bucket} {upload_id}\n"


class _Journal:
    """One daemon's upload journal, shared by every S3Storage of that owner: what it appends and what its trim keeps
    must be one list, or one writer's trim would drop the other's open uploads."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.open: dict[str, str] = {}
        """Upload id → its bucket: the uploads journaled and neither completed nor aborted."""
        self.lines = 0
        """Lines in the journal now."""

    def started(self, bucket: str, upload_id: str) -> None:
        with self.lock, open(self.path, "a") as f:
            f.write(_line(bucket, upload_id))
            self.open[upload_id] = bucket
            self.lines += 1

    def ended(self, upload_id: str) -> None:
        """The upload is completed or aborted, so no later daemon needs to abort it: once the journal is long, write
        it again with the open uploads alone, under a temporary name and renamed over it (a kill midway leaves the
        old journal whole, and the temporary one, which the next daemon reads too and removes with it)."""
        with self.lock:
            self.open.pop(upload_id, None)
            if self.lines <= max(TRIM_LINES, 2 * len(self.open)):
                return
            path = self.path
            trimmed = path.removesuffix(JOURNAL_SUFFIX) + ".trim" + JOURNAL_SUFFIX
            try:
                with open(trimmed, "w") as f:
                    f.write("".join(_line(bucket, upload_id) for upload_id, bucket in self.open.items()))
                os.replace(trimmed, path)
            except OSError as exc:  # /dev/shm full: the journal stays long, and right; no upload fails for it
                log.warning("cannot shorten the upload journal %s (%s); it is tried again later", path, exc)
                return
            self.lines = len(self.open)


_JOURNALS: dict[str, _Journal] = {}
_JOURNALS_LOCK = threading.Lock()


def _journal(path: str) -> _Journal:
    with _JOURNALS_LOCK:
        if path not in _JOURNALS:
            _JOURNALS[path] = _Journal(path)
        return _JOURNALS[path]


@dataclass
class _Upload:
    url: str
    where: ObjectPath
    upload_id: str
    parts: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Part number → its ETag and CRC32 (base64), as uploaded."""
    end: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False


class S3Storage(UploadedStorage):
    scheme = "s3"

    def __init__(self, *, journals: str = "", uploader: Any = None, **options: Any) -> None:
        """``journals``: the daemon's folder of locks, where it journals its uploads; ``uploader``: the upload
        process (``part(fd, url, upload_id, number, offset, length)`` → a future of (ETag, CRC32)); both only
        where this instance writes."""
        super().__init__(**options)
        self._lock = threading.Lock()
        self._journals = journals
        self._journal: _Journal | None = _journal(journal_path(journals, self.owner)) if journals else None
        """Where this instance's uploads are journaled; None where it never starts one (it reads, or only removes
        what a killed daemon left)."""
        self.uploader = uploader
        self.completed: dict[str, str] = {}
        """url → the ETag of the object this writer's last upload there made: the commit checks the object is still
        that one (``ObjectTiers.commit``), then forgets it."""

    def _call(self, what: str, url: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:
            if is_client_error(exc):
                raise object_error(what, url, exc) from None
            raise

    def create(self, path: str, token: str) -> _Upload:
        assert self._journal is not None, "an upload is started only by an instance made with its journals folder"
        where = ObjectPath.parse(path)
        s3 = client_for(path)
        reply = self._call("cannot start uploading", path, s3.create_multipart_upload, Bucket=where.bucket,
                           Key=where.key, ChecksumAlgorithm="CRC32",
                           Metadata={"datastates-owner": self.owner, "datastates-token": token[:128]})
        upload = _Upload(path, where, reply["UploadId"])
        self._journal.started(where.bucket, upload.upload_id)
        return upload

    def upload(self, handle: _Upload, fd: int, offset: int, length: int) -> Future:
        """Part ``offset // PART + 1``: ``length`` bytes of ``fd`` at ``offset`` (a multiple of PART), by the upload
        process; a future done once the part is uploaded and noted for ``finalize``, or of the StorageError why not."""
        if offset % PART:
            raise StorageError(f"cannot write {handle.url}: an object is uploaded in parts of {PART} bytes, and byte "
                               f"{offset} does not start one", path=handle.url)
        number = offset // PART + 1
        done: Future = Future()

        def noted(part: Future) -> None:
            try:
                etag, crc = part.result()
            except Exception as exc:  # noqa: BLE001 - handed on to the transfer
                done.set_exception(exc)
                return
            with handle.lock:
                handle.parts[number] = (etag, crc)
                handle.end = max(handle.end, offset + length)
            done.set_result(None)

        self.uploader.part(fd, handle.url, handle.upload_id, number, offset, length).add_done_callback(noted)
        return done

    def finalize(self, handle: _Upload) -> None:
        parts = sorted(handle.parts.items())
        if [n for n, _ in parts] != list(range(1, len(parts) + 1)):
            raise StorageError(f"cannot complete {handle.url}: parts {[n for n, _ in parts]} leave a gap", path=handle.url)
        s3 = client_for(handle.url)
        if not parts:  # an empty file: a multipart upload needs a part, so an empty object instead
            self.abort(handle)
            reply = self._call("cannot write", handle.url, s3.put_object, Bucket=handle.where.bucket,
                               Key=handle.where.key, Body=b"")
            with self._lock:
                self.completed[handle.url] = reply.get("ETag", "")
            return
        reply = self._call("cannot complete", handle.url, s3.complete_multipart_upload, Bucket=handle.where.bucket,
                           Key=handle.where.key, UploadId=handle.upload_id,
                           MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e, "ChecksumCRC32": c}
                                                      for n, (e, c) in parts]})
        handle.done = True
        with self._lock:
            self.completed[handle.url] = reply.get("ETag", "")
        self._journal.ended(handle.upload_id)
        size = self._call("cannot check", handle.url, s3.head_object, Bucket=handle.where.bucket,
                          Key=handle.where.key)["ContentLength"]
        if size != handle.end:
            raise StorageError(f"cannot complete {handle.url}: the server holds {size} bytes of {handle.end}",
                               path=handle.url)

    def abort(self, handle: _Upload) -> None:
        if handle.done:
            return
        handle.done = True
        try:
            client_for(handle.url).abort_multipart_upload(Bucket=handle.where.bucket, Key=handle.where.key,
                                                          UploadId=handle.upload_id)
        except Exception as exc:  # noqa: BLE001 - never raises: the next daemon's recovery aborts it
            log.warning("cannot abort the upload of %s (%s); the next daemon of this node aborts it",
                        handle.url, object_error("abort", handle.url, exc).message)
        else:
            self._journal.ended(handle.upload_id)

    def publish(self, path: str, data: bytes, check: Callable[[int], None] | None = None) -> None:
        """One PUT: the object appears whole. ``check`` asks of a folder descriptor, which an object store lacks:
        the caller checks its objects itself before (daemon/objecttiers.py)."""
        where = ObjectPath.parse(path)
        self._call("cannot write", path, client_for(path).put_object, Bucket=where.bucket, Key=where.key, Body=data)

    def remove_leftovers(self, root: str, gone: Gone) -> list[str]:
        """Abort the multipart uploads below ``root`` that a dead daemon of this node journaled; no other."""
        where = ObjectPath.parse(root)
        owners: dict[str, str] = {}
        """Upload id → the dead daemon that journaled it, for uploads in this root's bucket."""
        folder = self._journals
        for name in os.listdir(folder):
            owner = name.split(".", 1)[0]  # <owner>.uploads (an earlier version's: <owner>.adopted-<dead>.uploads)
            if not name.endswith(JOURNAL_SUFFIX) or owner == self.owner or not gone(owner, None):
                continue
            try:
                with open(os.path.join(folder, name), errors="replace") as f:
                    lines = f.read().splitlines()
            except FileNotFoundError:  # another daemon's recovery took it meanwhile
                continue
            for line in lines:
                fields = line.split(" ")
                if len(fields) == 2 and fields[0] == where.bucket:  # a line cut short by a kill is no upload
                    owners[fields[1]] = owner
        if not owners:
            return []
        aborted = []
        try:
            s3 = client_for(root)
            pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=where.bucket, Prefix=where.prefix)
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["UploadId"] in owners:
                        s3.abort_multipart_upload(Bucket=where.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        aborted.append(f"s3://{where.bucket}/{upload['Key']} (upload {upload['UploadId'][:12]})")
        except Exception as exc:
            if not (is_client_error(exc) or isinstance(exc, DatastatesError)):
                raise
            why = exc.message if isinstance(exc, DatastatesError) else object_error("list", root, exc).message
            log.warning("cannot abort the uploads killed daemons left below %s (%s): their journals stay for the "
                        "next daemon", root, why)
            self.kept |= set(owners.values())
        return aborted


    def read(self, path: str) -> bytes | None:
        return read_object(path)

    def open(self, path: str, reads: Reads = "small") -> ObjectFile:
        return ObjectFile.open(path)

    def list(self, folder: str) -> Iterator[tuple[str, int]]:
        return list_keys(folder)

    def exists(self, path: str) -> bool:
        where = ObjectPath.parse(path)
        try:
            client_for(path).head_object(Bucket=where.bucket, Key=where.key)
        except Exception as exc:
            if missing(exc):
                return False
            if is_client_error(exc):
                raise object_error("cannot read", path, exc) from None
            raise
        return True

    def is_folder(self, path: str) -> bool:
        return True

    def delete(self, path: str) -> None:
        delete_object(path)

    def absolute(self, path: str, resolve: bool = False) -> str:
        return path.rstrip("/")

    def join(self, folder: str, relative: str) -> str:
        return folder if relative == "." else f"{folder.rstrip('/')}/{relative}"

    def connect(self, url: str, endpoint: str = "", region: str = "") -> None:
        register(url, endpoint, region)

    def root_folders(self, path: str) -> list[str]:
        return []  # a server every node reaches: no folder of this node's

    def tier_path(self, path: str, first: bool) -> str:
        if first:
            raise ConfigError(f"{path!r}: the first tier is where snapshots land, a folder; an object store can only "
                              "be a later tier")
        return ObjectPath.parse(path).url

    def check_tier(self, tier: Tier) -> tuple[str, str]:
        if not tier.shared:
            return "shared", "an object store tier is seen by every node"
        for key, check in (("endpoint", check_endpoint), ("region", check_region)):
            why = check(getattr(tier, key))
            if why:
                return key, why
        return "", ""

    def check_next(self, tier: Tier, after: Tier) -> tuple[str, str]:
        if isinstance(backend_for(after.path), S3Storage):
            return "", ""
        return "path", (f"{after.path!r} comes after the object store tier {tier.name!r}; object store tiers come "
                        "last (each tier is written from the first)")

    def read_marker(self, path: str) -> CommitMarker | None:
        """Not a marker either where it lists a file outside its folder (``safe_name``)."""
        raw = self.read(path)
        try:
            marker = CommitMarker.decode(raw) if raw is not None else None
        except (ValueError, RecursionError, DatastatesError):
            return None
        return marker if marker is not None and all(safe_name(f.path) for f in marker.files) else None

    def whole(self, folder: str, marker: CommitMarker, sizes: dict[str, int] | None = None) -> bool:
        """``sizes``: one listing of ``folder`` made already."""
        sizes = dict(self.list(folder)) if sizes is None else sizes
        return not any(sizes.get(f"{folder}/{f.path}") != f.size for f in marker.files)

    def trusts(self, path: str) -> bool:
        return True  # who may write the bucket is its policy's to say

    def markers(self, root: str, depth: int, strict: bool) -> list[tuple[str, CommitMarker | None]]:
        """One listing of ``root``, and a GET of each marker object there, up to MARKER_READS at once (a run without
        ``keep_last`` holds a marker per save, each a round trip)."""
        root = root.rstrip("/")
        sizes = dict(self.list(root))
        paths = [path for path in sizes if is_marker_name(path.rsplit("/", 1)[1])
                 and path.rsplit("/", 1)[0][len(root):].count("/") <= depth]

        def read(path: str) -> CommitMarker | None:
            try:
                marker = self.read_marker(path)
                return marker if marker is not None and self.whole(path.rsplit("/", 1)[0], marker, sizes) else None
            except DatastatesError as exc:  # one marker refused (its own ACL, a key): the run's other tags still count
                if strict:
                    raise
                log.warning("skipping the commit marker %s: %s", path, exc.message)
                return None

        return list(zip(paths, _on_daemon_threads(read, paths, MARKER_READS)))

    def commits_of(self, path: str, depth: int, roots: Sequence[str] | None) -> list[tuple[str, CommitMarker,
                                                                                          MarkerFile]]:
        """A tag's objects lie in its own folder, its marker beside them."""
        folder = os.path.dirname(path)
        marker_path = f"{folder}/{marker_name(os.path.basename(folder))}"
        marker = self.read_marker(marker_path)
        entry = next((f for f in marker.files if f.path == os.path.basename(path)), None) if marker else None
        return [(marker_path, marker, entry)] if marker is not None and entry is not None else []

    def folders(self, root: str) -> list[tuple[str, str, int, int, int, bool]]:
        """From one listing: a folder's objects with no marker are ``uncommitted``, whatever they are."""
        sizes: dict[str, list[int]] = {}
        for url, size in self.list(root):
            name = url[len(root) + 1:].split("/", 1)[0]
            if "/" in url[len(root) + 1:] and not name.startswith("."):
                sizes.setdefault(name, []).append(size)
        return [(name, f"{root}/{name}", len(found), sum(found), 0, False) for name, found in sizes.items()]

    def files_at(self, target: str, skipped: Callable[[str, str], None]) -> list[str]:
        return self._files(target, named=False)

    def tag_files_named(self, root: str, tag: str, skipped: Callable[[str, str], None]) -> list[str]:
        return self._files(f"{root.rstrip('/')}/{tag}", named=True)

    def _files(self, target: str, named: bool) -> list[str]:
        """The objects a tag's marker object lists, or the object itself (``named``: the address is a tag's folder,
        named by the tag; never an object)."""
        folder = target.rstrip("/")
        name = os.path.basename(folder)
        try:
            marker = self.read_marker(f"{folder}/{marker_name(check_tag(name))}")
        except InvalidRequestError:  # not a tag's name: an object's
            marker = None
        if marker is not None:
            return tag_files(folder, marker)
        if named or next(self.list(folder), None) is not None:
            raise CorruptCheckpointError(f"no commit marker for {target!r} (no committed tag there)")
        return [target]

    def why_kept(self, tag: CommittedTag) -> str:
        try:
            return self._kept(tag, [url for url, _ in self.list(tag.folder)])
        except DatastatesError as exc:
            return exc.message

    def delete_tag(self, tag: CommittedTag, root: str) -> bool:
        """The marker object first (the tag is then not committed), then the objects. An object store has no rename:
        a delete cut short leaves objects without a marker (never a tag), which a lifecycle rule clears."""
        try:
            listed = [url for url, _ in self.list(tag.folder)]
            why = self._kept(tag, listed)
            if why:
                log.warning("not deleting checkpoint %s of %s: %s", tag.tag, tag.folder, why)
                return False
            self.delete(tag.marker_path)
            for url in listed:  # as listed before the guards: an object put there since is not this tag's
                if url != tag.marker_path:
                    self.delete(url)
        except DatastatesError as exc:  # a refusal, or a key no address can name (``a//b``): left as it is
            log.warning("cannot delete tag %s from %s: %s", tag.tag, root, exc.message)
            return False
        return True

    def _kept(self, tag: CommittedTag, listed: list[str]) -> str:
        """``kept`` of a tag whose folder holds ``listed``: a folder's guards (protocol/retention.py ``kept``) hold."""
        strangers = [url for url in listed if is_marker_name(url.rsplit("/", 1)[1]) and url != tag.marker_path]
        if strangers:
            return f"it also holds another tag's marker ({strangers[0].rsplit('/', 1)[1]})"
        if self.read_marker(tag.marker_path) != tag.marker:  # right before the delete: the window is a round trip
            return "it was committed again since it was listed, or its marker is gone"
        tracker = f"{tag.run}/{TRACKER}"
        if (self.read(tracker) or b"").decode(errors="replace").strip() == tag.tag:
            return f"the {TRACKER!r} tracker beside it names it"
        return ""

    def unchanged(self, folder: str, name: str, marker: CommitMarker) -> bool:
        """No rename here: a tag saved again has its objects replaced one by one, under no marker; so the marker is
        read again once the file is (the bucket just answered: an error is one)."""
        now = trusted_marker(os.path.join(folder, marker_name(marker.tag)))
        listed = next((f.snapshot for f in marker.files if f.path == name), None)
        return now is not None and now.sequence == marker.sequence and \
            next((f.snapshot for f in now.files if f.path == name), None) == listed

    def probe(self, fn: Callable[[str], T], place: str) -> Future:
        """On a daemon thread: one left waiting on a hung server never holds the process at its exit."""
        future: Future = Future()

        def run() -> None:
            try:
                future.set_result(fn(place))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(exc)

        threading.Thread(target=run, name="datastates-tier-probe", daemon=True).start()
        return future

    def unreachable(self, exc: DatastatesError) -> bool:
        return True  # a server down or refusing: another tier may hold the same tag


def safe_name(path: str) -> bool:
    """Whether a marker's file entry names an object inside the marker's folder: a relative key, no '.', '..' or
    empty part (an object store resolves none of them: ``a/../b`` is a key of its own)."""
    return bool(path) and not path.startswith("/") and all(p not in ("", ".", "..") for p in path.split("/"))


def _on_daemon_threads(fn: Callable[[str], T], items: list[str], at_once: int) -> list[T]:
    """``fn`` of each of ``items``, ``at_once`` at a time, in order; the first error raised once the calls under way
    end, and no new one started after it. On daemon threads: one waiting on a hung server never holds the process at
    its exit, as a ThreadPoolExecutor's would (a restore goes on without that server, client/locate.py)."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []
    todo = iter(range(len(items)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = None if errors else next(todo, None)
            if i is None:
                return
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=work, name="datastates-markers", daemon=True)
               for _ in range(min(at_once, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


register_backend(S3Storage)
