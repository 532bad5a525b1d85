"""The object store backend: ``S3Storage``.

S3, and the other servers of its API. Its addresses and client are address.py's, its reads reads.py's, its writes
writes.py's and its commit markers markers.py's.

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

from typing import ContextManager, Iterator

from ...descriptors import Tier
from ...errors import ConfigError
from ..base import Reads, UploadedStorage, backend_for, register_backend
from .address import (ObjectPath, check_endpoint, check_region, delete_object, list_keys, on_object, read_object,
                      register)
from .markers import ObjectMarkers
from .reads import ObjectFile, one_read
from .writes import MAX_PARTS, PART, ObjectWrites


class S3Storage(ObjectWrites, ObjectMarkers, UploadedStorage):
    """The object store backend: its writes (writes.py), its commit markers (markers.py), and here what it reads and
    how a tier of it is configured."""

    scheme = "s3"
    part = PART
    max_parts = MAX_PARTS

    def read(self, path: str) -> bytes | None:
        return read_object(path)

    def open(self, path: str, reads: Reads = "small") -> ObjectFile:
        return ObjectFile.open(path)

    def one_read(self, whole: bool = False) -> ContextManager[None]:
        return one_read(whole)

    def list(self, folder: str) -> Iterator[tuple[str, int]]:
        return list_keys(folder)

    def exists(self, path: str) -> bool:
        return on_object(path, lambda client, where: client.head_object(Bucket=where.bucket, Key=where.key)) is not None

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



register_backend(S3Storage)
