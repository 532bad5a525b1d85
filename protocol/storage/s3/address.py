"""Object store addresses (``s3://bucket/key``) and their client.

One client per endpoint and region, its retries and time limits, a failure in words, and the small calls (a GET of a
marker, a listing, a delete).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from ...errors import ConfigError, StorageError

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


def on_object(url: str, request: Callable[[Any, ObjectPath], T]) -> T | None:
    """``request(client, address)`` of the object at ``url``; None where there is none, and a refusal as a
    StorageError that names the object."""
    where = ObjectPath.parse(url)
    try:
        return request(client_for(url), where)
    except Exception as exc:
        if missing(exc):
            return None
        if is_client_error(exc):
            raise object_error("cannot read", url, exc) from None
        raise


def read_object(url: str) -> bytes | None:
    """A small object whole (a marker, a tracker), or None if there is none."""
    return on_object(url, lambda client, where: client.get_object(Bucket=where.bucket, Key=where.key)["Body"].read())


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

