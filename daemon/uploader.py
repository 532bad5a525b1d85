"""The upload process: an object store tier's part uploads, in a process of its own at the lowest CPU priority.

An upload costs CPU for every byte (the CRC32, TLS, botocore's building of each request: about 1.2 CPU s per GiB
here). On threads of the daemon at nice 19, an upload thread that held the daemon's GIL when the trainer took its
core held the whole daemon up (a snapshot's copy, a fence, a status call) until the scheduler gave it a turn again:
fences took 0.05 to 0.15 s a training run with the tier on, against none without. In a process of its own at nice
19 an upload takes only the CPU the trainer leaves and never holds the daemon; a crash there fails the parts it was
uploading, never the daemon, and the next part starts a new process.

The daemon side (``Uploader.part``) sends one ``Part`` per packet on a SOCK_SEQPACKET socket pair, as JSON, with the
source file's descriptor attached (SCM_RIGHTS): the process reads the very file the transfer opened, even where a
later save has replaced its path since. The process (``main``) reads the part into one of its PARTS_AT_ONCE buffers
(O_DIRECT where the descriptor is so), uploads it with its CRC32 in a header (the server checks it), closes the
descriptor, and answers ``{"id", "etag", "crc"}``, or ``{"id", "error", "code"}`` with the failure in words (at most
MAX_ERROR characters: a server's message has no bound). An answer the daemon cannot read stops the process, and fails
its parts. It dies with the daemon (PR_SET_PDEATHSIG, which fires when the thread that started it ends: it is started
from the event loop's thread, which lives as long as the daemon), and ends once the daemon closes its end. It runs with
``-P`` from ``/``, so that no module in the daemon's working folder (a training repository) shadows one of its own.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import errno
import io
import itertools
import json
import logging
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from datastates.protocol.errors import DatastatesError, ShuttingDownError, StorageError
from datastates.protocol.fileio import read_range
from datastates.protocol.storage.s3.address import ObjectPath, client, is_client_error, object_error, place_for
from datastates.protocol.storage.s3.writes import PART

try:
    from isal.isal_zlib import crc32  # ISA-L's: the same CRC32 as zlib's, about 10 times as fast (24 against 2 GB/s)
except ImportError:  # boto3 installed without the [s3] extra
    from zlib import crc32

log = logging.getLogger(__name__)

PARTS_AT_ONCE = 8
"""Parts uploaded at a time, each from a buffer of its own: 128 MiB in all, beside the daemon's ``host_memory``."""
UPLOAD_NICE = 19
"""The process's nice value: the lowest CPU priority that still gets a share of a busy core. Under ``SCHED_IDLE``
(``storage.upload_priority: idle``) it gets only CPU nothing else wants, and waits while the trainer keeps every core
busy."""
MAX_MESSAGE = 1 << 16
"""The longest message either way: a part's JSON (its key at most 1,024 bytes), an answer's."""
MAX_ERROR = 4096
"""The most characters of an error's words in an answer."""
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN)
"""What a send to a process that has ended fails with."""
CLOSE_WAIT_S = 5.0
"""How long a closing daemon waits for the process to end before it kills it."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Part:
    """One part to upload: ``length`` bytes at ``offset`` of the attached file, as part ``number`` of the multipart
    upload ``upload_id`` of ``url``, through ``endpoint`` and ``region`` ('': boto3's chain)."""

    id: int
    url: str
    upload_id: str
    number: int
    offset: int
    length: int
    endpoint: str
    region: str


class _Process:
    """One upload process, and the parts sent to it that it has not answered."""

    def __init__(self, places: list[tuple[str, str]], idle: bool) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", __name__, str(theirs.fileno()), str(os.getpid()),
                                          json.dumps(places), "idle" if idle else "low"],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, cwd="/")
        finally:
            theirs.close()
        self.sock = ours
        self.pending: dict[int, tuple[Future, str]] = {}
        """Part id → its future and address."""
        self.lock = threading.Lock()
        self.ended = False
        self.why = ""
        """Why the daemon stopped it, if it did."""
        threading.Thread(target=self._answers, name="ds-uploader", daemon=True).start()

    def send(self, part: Part, fd: int) -> Future:
        future: Future = Future()
        with self.lock:
            if self.ended:
                future.set_exception(self._gone(part.url))
                return future
            self.pending[part.id] = (future, part.url)
        try:
            socket.send_fds(self.sock, [json.dumps(dataclasses.asdict(part)).encode()], [fd])
        except OSError as exc:
            if exc.errno in _GONE:  # its answers' thread fails what it left, this part included
                self.stop()
                return future
            with self.lock:
                taken = self.pending.pop(part.id, None)
            if taken is not None:  # this part alone: the process goes on with the others
                future.set_exception(StorageError(f"cannot upload to {part.url}: cannot hand the part to the upload "
                                                  f"process: {exc.strerror or exc}", path=part.url))
        return future

    def stop(self) -> None:
        """Let the process end: it finishes the parts under way, unanswered; its answers' thread kills it past
        CLOSE_WAIT_S, then fails every part it had not answered."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _answers(self) -> None:
        try:
            while True:
                try:
                    data, _, flags, _ = self.sock.recvmsg(MAX_MESSAGE)
                except OSError:
                    break
                if not data:
                    break
                if flags & socket.MSG_TRUNC:
                    raise ValueError(f"an answer longer than {MAX_MESSAGE} bytes")
                answer = json.loads(data)
                with self.lock:
                    future, url = self.pending.pop(answer["id"])
                if "error" in answer:
                    future.set_exception(StorageError(answer["error"], path=url, code=answer["code"]))
                else:
                    future.set_result((answer["etag"], answer["crc"]))
        except Exception as exc:  # noqa: BLE001 - an answer it cannot read: no later one can be trusted either
            self.why = f"was stopped: it sent an answer that cannot be read ({type(exc).__name__}: {exc})"
            log.error("the upload process (pid %d) %s", self.proc.pid, self.why)
            self.proc.kill()
        try:
            self.proc.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        with self.lock:
            self.ended = True
            left, self.pending = list(self.pending.values()), {}
        if left:
            log.warning("the upload process (pid %d) %s with %d part(s) unanswered: their transfers fail, and the "
                        "next part starts a new process", self.proc.pid, self._end(), len(left))
        for future, url in left:
            future.set_exception(self._gone(url))

    def _end(self) -> str:
        code = self.proc.returncode
        return self.why or (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")

    def _gone(self, url: str) -> StorageError:
        return StorageError(f"cannot upload to {url}: the upload process (pid {self.proc.pid}) {self._end()}",
                            path=url)



class Uploader:
    """The daemon's handle on its upload process, started with the first part and again after it ended."""

    def __init__(self, idle: bool = False) -> None:
        self._idle = idle
        self._process: _Process | None = None
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self.started = 0
        """How many upload processes this daemon has started (more than one: one ended, and status says so)."""

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.ended else process.proc.pid

    def start(self, places: list[tuple[str, str]] | None = None) -> _Process:
        """The upload process, started if there is none: at the daemon's start, with its tiers' endpoints and regions
        (``places``), so that no upload waits for it, nor for botocore's making of their clients (its model files:
        about a CPU second, which the first upload of a training run would take from the trainer)."""
        with self._lock:
            if self._closed:
                raise ShuttingDownError("the daemon is shutting down: no upload starts")
            if self._process is None or self._process.ended:
                self._process = _Process(places or [], self._idle)
                self.started += 1
            return self._process

    def part(self, fd: int, url: str, upload_id: str, number: int, offset: int, length: int) -> Future:
        """Upload ``length`` bytes at ``offset`` of ``fd`` as part ``number`` of ``upload_id``: a future of the part's
        ETag and CRC32 (base64), or of the StorageError saying why not. ``fd`` stays the caller's to close."""
        part = Part(next(self._ids), url, upload_id, number, offset, length, *place_for(url))
        return self.start().send(part, fd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._process is not None:
                self._process.stop()


# -- the process ------------------------------------------------------------------------------


class _Body(io.RawIOBase):
    """A part's bytes for botocore, read out of its buffer as they are sent: no copy of the whole part (bytes would
    be one, 16 MiB a part), and seekable, so that a retry sends them again from the start."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._data) - self._at))
        b[:n] = self._data[self._at:self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self._at = (offset, self._at + offset, len(self._data) + offset)[whence]
        return self._at

    def tell(self) -> int:
        return self._at


def _upload(part: Part, fd: int, buf: mmap.mmap) -> dict[str, str]:
    data = read_range(fd, buf, part.offset, part.length)
    crc = base64.b64encode(crc32(data).to_bytes(4, "big")).decode()  # in a header: no chunked trailer
    where = ObjectPath.parse(part.url)
    reply = client(part.endpoint, part.region).upload_part(
        Bucket=where.bucket, Key=where.key, UploadId=part.upload_id, PartNumber=part.number, Body=_Body(data),
        ChecksumCRC32=crc)
    return {"etag": reply["ETag"], "crc": crc}


def _serve(sock: socket.socket, sending: threading.Lock, buffers: queue.SimpleQueue, part: Part, fd: int) -> None:
    buf = buffers.get()
    try:
        answer: dict[str, object] = {"id": part.id, **_upload(part, fd, buf)}
    except Exception as exc:  # noqa: BLE001 - every failure is answered: the transfer fails with its words
        error = exc if isinstance(exc, DatastatesError) else object_error("cannot upload to", part.url, exc) \
            if is_client_error(exc) else StorageError(f"cannot upload to {part.url}: {type(exc).__name__}: {exc}")
        answer = {"id": part.id, "error": error.message[:MAX_ERROR], "code": str(error.detail.get("code", ""))[:64]}
    finally:
        os.close(fd)
        buffers.put(buf)
    try:
        with sending:
            sock.send(json.dumps(answer).encode())
    except OSError:  # the daemon is gone or closing: no one to answer
        pass


def main(argv: list[str]) -> int:
    """The upload process: ``argv`` is its socket's descriptor, the daemon's pid, the endpoints and regions to make
    clients for now (JSON), and its priority (``low`` or ``idle``)."""
    sock_fd, daemon, places, priority = int(argv[0]), int(argv[1]), json.loads(argv[2]), argv[3]
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != daemon:  # the daemon died before the line above
        return 0
    # its clients first, at the daemon's priority (the process starts with the daemon, before the trainers; started
    # again after one died, it takes that from them once): boto3's import and a client's making cost about 0.2 CPU s,
    # which at nice 19 behind a busy node took a minute and held the first upload as long (under SCHED_IDLE, as long
    # as the node stayed busy)
    for endpoint, region in places:
        try:
            client(endpoint, region)
        except DatastatesError:  # said again by the first part there, as the failure of its transfer
            pass
    os.setpriority(os.PRIO_PROCESS, 0, max(UPLOAD_NICE, os.getpriority(os.PRIO_PROCESS, 0)))  # every thread's
    if priority == "idle":
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # inherited by the threads started below
    sock = socket.socket(fileno=sock_fd)
    buffers: queue.SimpleQueue = queue.SimpleQueue()
    for _ in range(PARTS_AT_ONCE):
        buffers.put(mmap.mmap(-1, PART))
    sending = threading.Lock()
    pool = ThreadPoolExecutor(PARTS_AT_ONCE, thread_name_prefix="ds-upload")
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        except OSError:
            break
        if not data:
            break
        pool.submit(_serve, sock, sending, buffers, Part(**json.loads(data)), fds[0])
    pool.shutdown(cancel_futures=True)  # the parts under way end, the waiting ones with the process
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
