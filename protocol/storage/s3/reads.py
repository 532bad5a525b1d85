"""Reading an object by ranges: ``ObjectFile`` and ``one_read``.

``one_read`` shares one ETag and one read of the object's head among the reads of one load.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

from ...errors import CorruptCheckpointError, StorageError
from .address import _REFUSED, ObjectPath, client_for, is_client_error, missing, object_error

READ_STREAMS = 8
"""Ranged GETs of one object at once: a load's threads on an object (a file's are READ_THREADS)."""

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


