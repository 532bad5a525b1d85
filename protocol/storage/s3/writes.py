"""Writing objects: a journaled multipart upload per file; ``publish`` is one PUT.

The parts are uploaded by the upload process (daemon/uploader.py); the journal lets the next daemon of this node abort
what a killed one left open.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ...errors import DatastatesError, StorageError
from ..base import Gone
from .address import ObjectPath, client_for, is_client_error, list_etags, object_error

log = logging.getLogger(__name__)

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



class ObjectWrites:
    """The write half of ``S3Storage`` (protocol/storage/s3/__init__.py): create, upload, finalize, abort, publish,
    and the clean-up of a killed daemon's uploads."""

    owner: str
    kept: set[str]

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
        that one (``replaced``), then forgets it."""

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

    def replaced(self, folder: str, paths: Iterable[str]) -> str:
        """By ETag, from one listing."""
        etags = list_etags(folder)
        for path in paths:
            made = self.completed.pop(path, None)
            if made is None or etags.get(path) != made:
                return path
        return ""

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

