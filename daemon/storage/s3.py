"""The object store writer: a file becomes one object by a multipart upload, visible only once complete.

``create`` starts a multipart upload and journals its id beside this daemon's lock
(daemon/instances.py), ``write`` uploads one part (``PART`` bytes at a multiple of it; the
last may be shorter), from any thread and in any order, ``finalize`` completes it (the object
appears whole, or not at all), ``abort`` aborts it. ``publish`` is one PUT (markers,
trackers): an object store has no rename, so a marker is written only once every object it
lists is complete, which is what makes it last. A killed daemon's uploads stay open on the
server (and are billed) until the next daemon of this node aborts those its journal names:
no other daemon's upload is ever touched. A bucket lifecycle rule that aborts incomplete
uploads after a day covers a node that never comes back (docs/deploy.md).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from datastates.protocol.errors import StorageError
from datastates.protocol.objectstore import ObjectPath, client_for, is_client_error, missing, object_error

from ..instances import Gone, daemons_folder
from .base import StorageWriter, register_writer

log = logging.getLogger(__name__)

PART = 16 << 20
"""Bytes of one uploaded part: a tier transfer's piece. 10,000 parts (the S3 limit) make a 160 GiB file at most."""
JOURNAL_SUFFIX = ".uploads"


def journal_path(owner: str) -> str:
    """Where the daemon ``owner`` notes the multipart uploads it starts: one line each, bucket, key and upload id."""
    return os.path.join(daemons_folder(), owner + JOURNAL_SUFFIX)


@dataclass
class _Upload:
    url: str
    where: ObjectPath
    upload_id: str
    parts: dict[int, str] = field(default_factory=dict)
    """Part number → its ETag, as uploaded."""
    end: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: bool = False


class S3Writer(StorageWriter):
    scheme = "s3"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._journal_lock = threading.Lock()

    def _call(self, what: str, url: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as exc:
            if is_client_error(exc):
                raise object_error(what, url, exc) from None
            raise

    def create(self, path: str, token: str, reuse: str = "") -> _Upload:
        where = ObjectPath.parse(path)
        s3 = client_for(path)
        reply = self._call("cannot start uploading", path, s3.create_multipart_upload, Bucket=where.bucket,
                           Key=where.key, Metadata={"datastates-owner": self.owner, "datastates-token": token[:128]})
        upload = _Upload(path, where, reply["UploadId"])
        with self._journal_lock, open(journal_path(self.owner), "a") as f:
            f.write(f"{where.bucket} {upload.upload_id} {where.key}\n")
        return upload

    def write(self, handle: _Upload, offset: int, data: memoryview) -> None:
        if offset % PART:
            raise StorageError(f"cannot write {handle.url}: an object is uploaded in parts of {PART} bytes, and byte "
                               f"{offset} does not start one", path=handle.url)
        number = offset // PART + 1
        reply = self._call("cannot upload to", handle.url, client_for(handle.url).upload_part,
                           Bucket=handle.where.bucket, Key=handle.where.key, UploadId=handle.upload_id,
                           PartNumber=number, Body=bytes(data))
        with handle.lock:
            handle.parts[number] = reply["ETag"]
            handle.end = max(handle.end, offset + len(data))

    def finalize(self, handle: _Upload) -> None:
        parts = sorted(handle.parts.items())
        if [n for n, _ in parts] != list(range(1, len(parts) + 1)):
            raise StorageError(f"cannot complete {handle.url}: parts {[n for n, _ in parts]} leave a gap", path=handle.url)
        s3 = client_for(handle.url)
        if not parts:  # an empty file: a multipart upload needs a part, so an empty object instead
            self.abort(handle)
            self._call("cannot write", handle.url, s3.put_object, Bucket=handle.where.bucket, Key=handle.where.key,
                       Body=b"")
            return
        self._call("cannot complete", handle.url, s3.complete_multipart_upload, Bucket=handle.where.bucket,
                   Key=handle.where.key, UploadId=handle.upload_id,
                   MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in parts]})
        handle.done = True
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

    def publish(self, path: str, data: bytes, check: Callable[[int], None] | None = None) -> None:
        """One PUT: the object appears whole. ``check`` asks of a folder descriptor, which an object store lacks:
        the caller checks its objects itself before (daemon/objects.py)."""
        where = ObjectPath.parse(path)
        self._call("cannot write", path, client_for(path).put_object, Bucket=where.bucket, Key=where.key, Body=data)

    def remove(self, path: str) -> None:
        """Delete one object; one already gone is no error."""
        where = ObjectPath.parse(path)
        try:
            client_for(path).delete_object(Bucket=where.bucket, Key=where.key)
        except Exception as exc:
            if not missing(exc):
                if is_client_error(exc):
                    raise object_error("cannot delete", path, exc) from None
                raise

    def remove_leftovers(self, root: str, gone: Gone) -> list[str]:
        """Abort the multipart uploads below ``root`` that a dead daemon of this node journaled; no other."""
        owners: dict[tuple[str, str], str] = {}
        folder = daemons_folder()
        for name in os.listdir(folder):
            owner = name.removesuffix(JOURNAL_SUFFIX)
            if not name.endswith(JOURNAL_SUFFIX) or owner == self.owner:
                continue
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    bucket, upload_id, _ = line.rstrip("\n").split(" ", 2)
                    owners[(bucket, upload_id)] = owner
        if not owners:
            return []
        where = ObjectPath.parse(root)
        s3 = client_for(root)
        aborted = []
        pages = s3.get_paginator("list_multipart_uploads").paginate(Bucket=where.bucket, Prefix=where.prefix)
        try:
            for page in pages:
                for upload in page.get("Uploads", []):
                    owner = owners.get((where.bucket, upload["UploadId"]))
                    if owner is not None and gone(owner, None):
                        s3.abort_multipart_upload(Bucket=where.bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                        aborted.append(f"s3://{where.bucket}/{upload['Key']} (upload {upload['UploadId'][:12]})")
        except Exception as exc:
            if is_client_error(exc):
                log.warning("cannot abort the uploads killed daemons left below %s: %s", root,
                            object_error("list", root, exc).message)
                return aborted
            raise
        return aborted


register_writer(S3Writer)
