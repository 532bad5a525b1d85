"""Object storage (S3 and its API's other servers): addresses, the client, and reading, for both sides.

A tier or a checkpoint path may be ``s3://bucket/prefix``: a tag lies at
``<prefix>/<run>/<tag>/<file>``, the layout of a file tier, with its commit marker object
written last. The daemon writes there (daemon/storage/s3.py); the client reads
(``latest``, ``load``, ``Client.restore``) through ``ObjectFile``.

The client is botocore's (boto3), chosen by measurement on this machine against a local
S3 server (docs/performance.md): it reads as fast as obstore from the same server, and it
alone lists and aborts multipart uploads, which the clean-up after a killed daemon needs.
Its own chain finds the endpoint, region and credentials: the ``AWS_*`` environment
variables (``AWS_ENDPOINT_URL`` included), profile files, instance metadata. A tier's
``endpoint`` and ``region`` keys override the first two; secrets are never in the node
config. Path-style addressing wherever an endpoint is given (a local server's buckets are
not host names). Retries: botocore's standard mode, exponential backoff with jitter on 5xx,
throttling and dropped connections. Every uploaded part carries a CRC32 the server checks,
which also spares the SHA-256 of each part that signing its payload would cost the node's
CPU; downloads are checked against the file's own checksums.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterator

from .errors import ConfigError, CorruptCheckpointError, StorageError

SCHEME = "s3://"
ATTEMPTS = 6
"""Tries of one request (botocore's standard retry mode: backoff with jitter, at most 20 s apart)."""
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
"""A server silent this long on an open request fails that try (then retried)."""
READ_STREAMS = 8
"""Ranged GETs of one object at once: a load's threads on an object (a file's are READ_THREADS)."""
POOL = 32
"""Connections per client: the parallel part uploads and ranged reads of every file at once."""
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENDPOINT_RE = re.compile(r"https?://[A-Za-z0-9.\[\]:-]+(:[0-9]{1,5})?/?")
_REGION_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def is_object(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an object store address rather than a file system path (a ``Path`` never is one)."""
    return isinstance(path, str) and path.startswith(SCHEME)


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


_PLACES: dict[str, tuple[str, str]] = {}
"""Tier address → its (endpoint, region) keys: what every address below it is reached through."""


def register(url: str, endpoint: str = "", region: str = "") -> None:
    """Reach the objects below ``url`` (a tier's path) through ``endpoint`` and ``region`` ('': boto3's chain)."""
    _PLACES[url.rstrip("/") + "/"] = (endpoint, region)


def client_for(url: str) -> Any:
    """The client for ``url``: its tier's endpoint and region where registered, else boto3's chain."""
    return client(*next((v for k, v in _PLACES.items() if (url.rstrip("/") + "/").startswith(k)), ("", "")))


@functools.lru_cache(maxsize=None)
def client(endpoint: str = "", region: str = "") -> Any:
    """The shared botocore client for this endpoint and region ('': found by boto3's chain); thread-safe."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("an s3:// path needs boto3: pip install 'datastates[s3]'") from None
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
    config = Config(retries={"mode": "standard", "max_attempts": ATTEMPTS}, max_pool_connections=POOL,
                    connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    s3={"addressing_style": "path"} if endpoint else {}, response_checksum_validation="when_required")
    try:
        session = boto3.session.Session()
        return session.client("s3", endpoint_url=endpoint or None,
                              region_name=region or session.region_name or "us-east-1", config=config)
    except Exception as exc:  # a malformed endpoint or region, an unreadable profile: botocore's own words
        raise ConfigError(f"cannot reach an object store at {endpoint or 'AWS'!r}: {exc}") from None


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
"""The object's first bytes, read in one GET at the first small read there: a checkpoint's index, header and zip
head are read in a few small reads, each a round trip (and, on some servers, a read of the whole object) of its own."""
AHEAD_BYTES = 64 << 20
"""A GET asks for this much past the bytes wanted, and a thread's next read that starts where its last ended goes on
reading the same response: a piece's steps (client/stream.py) cost one request, not one each."""
_SHARED: contextvars.ContextVar[dict[str, ObjectFile] | None] = contextvars.ContextVar("datastates_objects",
                                                                                     default=None)


@contextlib.contextmanager
def one_read() -> Iterator[None]:
    """Within it, ``ObjectFile.open`` of one address is one ObjectFile: the reads of one load share one HEAD, one
    ETag (so every read is of the same object) and one read of its head."""
    opened: dict[str, ObjectFile] = {}
    token = _SHARED.set(opened)
    try:
        yield
    finally:
        _SHARED.reset(token)
        for f in opened.values():
            f.close()


class ObjectFile:
    """A committed object read by ranges, as a file by ``os.preadv``: each range one GET, the bytes read straight into
    the caller's buffers. Every GET asks for the ETag seen at open: an object replaced meanwhile fails the read rather
    than mix two saves' bytes."""

    @classmethod
    def open(cls, url: str) -> ObjectFile:
        """The object at ``url``: the one opened already within ``one_read``, else a new one."""
        shared = _SHARED.get()
        if shared is None:
            return cls(url)
        if url not in shared:
            shared[url] = cls(url)
        return shared[url]

    def __init__(self, url: str) -> None:
        self.url = url
        self._where = ObjectPath.parse(url)
        self._client = client_for(url)
        try:
            head = self._client.head_object(Bucket=self._where.bucket, Key=self._where.key)
        except Exception as exc:
            if missing(exc):
                raise FileNotFoundError(2, "no such object", url) from None
            if is_client_error(exc):
                raise object_error("cannot read", url, exc) from None
            raise
        self.size: int = head["ContentLength"]
        self._etag: str = head.get("ETag", "")
        if not self._etag:
            raise StorageError(f"cannot read {url}: the server names no ETag for it, so its reads cannot be pinned to "
                               "one version of it", path=url)
        self._head: bytes | None = None
        self._head_lock = threading.Lock()
        self._lock = threading.Lock()
        self._streams: dict[int, tuple[Any, int, int]] = {}
        """Per thread: the response it reads on, the byte it is at, and where that response ends."""

    def pread(self, length: int, at: int) -> bytes:
        length = max(0, min(length, self.size - at))
        if at + length <= HEAD_BYTES:
            with self._head_lock:
                if self._head is None:
                    buf = bytearray(min(self.size, HEAD_BYTES))
                    self._get([memoryview(buf)], 0, len(buf), len(buf))
                    self._head = bytes(buf)
            return self._head[at:at + length]
        buf = bytearray(length)
        self.preadv([memoryview(buf)], at)
        return bytes(buf)

    def preadv(self, buffers: list[memoryview], at: int) -> int:
        """Fill ``buffers`` in order from byte ``at``; the bytes read (short only at the object's end). On the response
        this thread's last read left off at ``at``, else on a new ranged GET."""
        total = min(sum(len(b) for b in buffers), self.size - at)
        if total <= 0:
            return 0
        return self._get(buffers, at, total, min(self.size - at, total + AHEAD_BYTES))

    def _get(self, buffers: list[memoryview], at: int, total: int, ahead: int) -> int:
        thread = threading.get_ident()
        with self._lock:
            stream = self._streams.pop(thread, None)
        try:
            if stream is None or stream[1] != at or stream[2] < at + total:
                if stream is not None:
                    stream[0].close()
                body = self._client.get_object(Bucket=self._where.bucket, Key=self._where.key, IfMatch=self._etag,
                                               Range=f"bytes={at}-{at + ahead - 1}")["Body"]
                stream = (body, at, at + ahead)
            body, _, end = stream
            got = 0
            for buf in buffers:
                view = buf.cast("B")[:total - got]
                while len(view):
                    n = body.readinto(view)
                    if not n:
                        raise CorruptCheckpointError(f"{self.url}: the object ended at byte {at + got}", path=self.url)
                    got += n
                    view = view[n:]
                if got >= total:
                    break
            if at + got < end:
                with self._lock:
                    self._streams[thread] = (body, at + got, end)
            else:
                body.close()
            return got
        except Exception as exc:
            if stream is not None:
                stream[0].close()
            if missing(exc):
                raise FileNotFoundError(2, "the object was deleted while it was read", self.url) from None
            if is_client_error(exc):
                raise object_error("cannot read", self.url, exc) from None
            raise

    def close(self) -> None:
        """Let go of the responses the reading threads left open (read ahead, not needed)."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for body, _, _ in streams:
            body.close()
