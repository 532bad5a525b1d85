"""Power loss: every write not yet flushed is gone, and what "committed" promises still holds.

A kill -9 (tests/faults/test_kill_daemon.py, test_resave.py) keeps the page cache: every
write the daemon made survives it. A power loss keeps only what was flushed, so only the
order of fsyncs protects a tag. After a power loss at any point, these must hold:

- I1: every tag that has a commit marker (outside hidden folders) is whole: the marker
  parses, every file it lists has its size, loads bitwise equal to one saved step and
  passes ``verify``; all files of a tag hold the same step;
- I2: a tag whose ``commit()`` had resolved before the loss is still committed, with that
  version or a newer re-save of it;
- I4: ``datastates.latest(run)`` and the ``latest`` tracker name a committed, whole tag at
  least as new as the last one whose ``commit()`` resolved;
- I5: nothing under a temporary name is trusted; the next daemon removes those leftovers.

Two ways to cut the power:

(a) ``test_dm_flakey_drops_unflushed_writes`` (xfstests-style): the daemon's root is an ext4
    on a loop device under ``dm-flakey``. At a random point of a run of saves the table is
    switched to ``drop_writes``, the daemon killed, the file system unmounted (its last
    writes dropped too) and mounted again, and the invariants are checked on what the
    device kept. It needs device-mapper in the kernel, and skips without it.

(b) ``test_every_crash_point_of_a_traced_run_keeps_the_invariants``, which runs anywhere
    strace can trace: the daemon runs under ``strace -f``, which records every file-system
    call it makes, with the bytes of every write (``-e write=all``), while a client saves
    and commits the same tags (``last`` saved again twice). The log is replayed onto a
    model of the root under a conservative crash model:

    - a file's bytes survive only once an fsync/fdatasync of that file *began* after the
      write returned;
    - a folder entry change (create, mkdir, rename, exchange, unlink, rmdir) survives only
      once an fsync of that folder began after the change returned (a rename changes two
      folders: each needs its own fsync);
    - nothing else survives: not sync_file_range, not O_DIRECT, not a close.

    Two states are built at each crash point: "kept", where only fsynced entries exist (a
    lost rename, a lost unlink), and "metadata first", where every entry change has reached
    the disk but file bytes only where fsynced (the zero-length file of a rename before
    fsync). Crash points: after every fsync (both states), as every entry change begins
    ("metadata first"), at the instant each ``commit()`` resolved in the client (its
    ``time.time()``, on the clock of strace's ``-ttt``; ``-T`` gives each call's return), and
    at the end. Each distinct state is written out as a real folder (a file is as long as
    its durable writes) and judged by ``datastates.latest``, ``load`` and ``verify``
    themselves, not by a model of them. The replay of the whole log, all writes kept, must
    equal the real root byte for byte, and a call the replay does not model fails the test
    if it touches the root: a call that escaped the model cannot hide a loss.

    Why the order of the log is safe to replay: strace stops a thread at each traced entry
    and return until it has logged it, so whatever a thread does after a call (answer a
    COMMIT, hand an fd to another thread) comes after that line. An entry change shows to
    other threads between its entry and its return, so it is applied to the names as it
    begins (and an fd a close frees as the close begins), but counted durable only from
    its return: a folder fsync that overlaps it does not cover it.

``test_the_next_daemon_removes_what_a_power_loss_left`` starts a daemon on the crash
state with the most temporary files and staging folders, as a reboot finds it: the dead
daemon's lock in ``/dev/shm`` is gone with the power.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import yaml

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify
from datastates.protocol.errors import DatastatesError
from datastates.protocol.format import MARKER_PREFIX, MARKER_SUFFIX, STAGING_SUFFIX, TEMP_SUFFIX, TRACKER
from datastates.protocol.paths import SHM_DIR
from datastates.protocol.tags import read_marker

from conftest import DATASTATESD, DaemonFactory, assert_state_equal, sh, wait_ready

RUN = "run"
TAGS = ("s1", "last", "s2", "last", "s3", "last")
"""The workload's commits, in order: ``last`` is saved again twice, each time after its previous commit resolved."""
FILES = {"model.pt": 10_000, "optim.pt": 3_000}
"""float32 elements per file: 40 KB is three 16 KiB pieces, 12 KB is one."""
SMALL = {"host_memory": "256KiB", "chunk_size": "16KiB", "memory_restore": "none", "prefault": False}
TRACED = ("openat,open,creat,write,pwrite64,writev,pwritev,pwritev2,fsync,fdatasync,sync_file_range,sync,syncfs,"
          "rename,renameat,renameat2,unlink,unlinkat,rmdir,mkdir,mkdirat,link,linkat,symlink,symlinkat,truncate,"
          "ftruncate,fallocate,copy_file_range,sendfile,close,dup,dup2,dup3,fcntl")
"""Every call that can name, change or flush a file: one the replay does not model fails the test if it touches the root."""


# -- the workload, and the invariants on what a crash left ------------------------------------


@dataclass
class Commit:
    """One ``commit()`` of the workload: what it saved, and when the client saw it resolve."""

    ordinal: int
    tag: str
    states: dict[str, dict[str, Any]] = field(repr=False)
    resolved: float = math.inf


def state_of(ordinal: int, name: str) -> dict[str, Any]:
    """A file's state at step ``ordinal``: random bytes, so two steps never match by chance."""
    g = torch.Generator().manual_seed(1000 * ordinal + len(name))
    return {"w": torch.randn(FILES[name], generator=g), "ordinal": ordinal, "file": name}


def run_workload(c: Client, run: Path,
                 before: Callable[[int, list[Commit]], None] = lambda k, done: None) -> list[Commit]:
    """Save and commit TAGS as a trainer does (commits overlap the next saves); ``before(k, commits)`` runs before step k."""
    commits: list[Commit] = []
    pending: dict[str, Future] = {}
    for k, tag in enumerate(TAGS):
        before(k, commits)
        if tag in pending:  # a tag is saved again only once its previous commit resolved
            pending.pop(tag).result(timeout=120)
        commit = Commit(k, tag, {name: state_of(k, name) for name in FILES})
        for name in FILES:
            c.snapshot(state_of(k, name), run / tag / name, tag=tag)
        c.wait()
        fut = c.commit(tag)
        fut.add_done_callback(lambda f, commit=commit: setattr(commit, "resolved", time.time()))
        pending[tag] = fut
        commits.append(commit)
    for fut in pending.values():
        fut.result(timeout=120)
    return commits


class Verdicts:
    """Which step a file holds, by its bytes and its marker's: each distinct file is loaded and verified once."""

    def __init__(self, commits: list[Commit]) -> None:
        self._commits = commits
        self._seen: dict[tuple[str, str], int | str] = {}

    def ordinal(self, path: Path, marker: Path, tag: str) -> int:
        """The commit whose state ``path`` holds; AssertionError if it does not load, verify, or match one."""
        key = (hashlib.sha1(path.read_bytes()).hexdigest(), hashlib.sha1(marker.read_bytes()).hexdigest())
        if key not in self._seen:
            self._seen[key] = self._judge(path, tag)
        found = self._seen[key]
        if isinstance(found, str):
            raise AssertionError(f"{path.name} of tag {tag!r}: {found}")
        return found

    def _judge(self, path: Path, tag: str) -> int | str:
        """The ordinal, or why the file is not a whole saved step of ``tag``."""
        try:
            verify(path)
            loaded = datastates.load(path)
        except (DatastatesError, OSError) as exc:
            return f"does not load: {exc}"
        for c in self._commits:
            if c.tag == tag:
                try:
                    assert_state_equal(c.states[path.name], loaded)
                    return c.ordinal
                except (AssertionError, KeyError):
                    continue
        return "loads, but holds no state ever saved under its tag"


def check_invariants(run: Path, resolved: list[Commit], verdicts: Verdicts) -> dict[str, int]:
    """I1, I2, I4 and I5 on the folder ``run`` as a crash left it; the committed tags and the step each holds.

    I5 is that every file a marker lists (a final name) loads whole: what the daemon wrote under a temp
    name and renamed is trusted only because its bytes were durable first.
    """
    committed: dict[str, int] = {}
    for folder in [run, *sorted(p for p in run.iterdir() if p.is_dir() and not p.name.startswith("."))]:
        for marker_path in sorted(folder.glob(f"{MARKER_PREFIX}*{MARKER_SUFFIX}")):
            marker = read_marker(str(marker_path))
            assert marker is not None, (f"I1: durable marker {marker_path.relative_to(run)} is torn, or a file it lists "
                                        "is missing or short")
            assert folder.name == marker.tag and sorted(f.path for f in marker.files) == sorted(FILES), marker
            steps = {verdicts.ordinal(folder / f.path, marker_path, marker.tag) for f in marker.files}
            assert len(steps) == 1, f"I1: tag {marker.tag!r} mixes steps {sorted(steps)}"
            committed[marker.tag] = steps.pop()
    for c in resolved:
        assert committed.get(c.tag, -1) >= c.ordinal, (
            f"I2: tag {c.tag!r} (commit #{c.ordinal}) had resolved, but the crash left "
            + (f"step #{committed[c.tag]} of it" if c.tag in committed else "it uncommitted"))
    newest = max((c.ordinal for c in resolved), default=-1)
    latest = datastates.latest(run)
    assert (latest is None and newest < 0) or committed.get(latest, -2) >= newest, (
        f"I4: latest() is {latest!r} (step {committed.get(latest)}), older than commit #{newest}, which had resolved")
    tracker = run / TRACKER
    if tracker.exists() or newest >= 0:
        named = tracker.read_bytes().decode(errors="replace") if tracker.is_file() else None
        assert committed.get(named, -1) >= max(newest, 0), (
            f"I4: the {TRACKER} tracker names {named!r} (step {committed.get(named)}); committed: {committed}, "
            f"last resolved commit #{newest}")
    return committed


def leftovers(root: Path) -> list[Path]:
    """Temporary files and staging folders: what a crashed daemon may leave, never trusted by a reader."""
    return sorted(p for p in root.rglob("*") if p.name.endswith((TEMP_SUFFIX, STAGING_SUFFIX)))


# -- (a) dm-flakey ------------------------------------------------------------------------------


def dm_flakey_missing() -> str | None:
    """Why a dm-flakey device cannot be made here, or None."""
    if os.geteuid() != 0:
        return "dm-flakey needs root"
    for tool in ("dmsetup", "losetup", "blockdev", "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    version = sh("dmsetup", "version")
    if version.returncode != 0:
        first = (version.stderr.strip().splitlines() or ["failed"])[0]
        return f"this kernel has no device-mapper: `dmsetup version`: {first}"
    if "flakey" not in sh("dmsetup", "targets").stdout:
        sh("modprobe", "dm-flakey")
        if "flakey" not in sh("dmsetup", "targets").stdout:
            return "device-mapper has no flakey target (modprobe dm-flakey failed)"
    return None


@dataclass
class Flakey:
    """An ext4 on a loop device under dm-flakey, mounted at ``mnt``."""

    name: str
    loop: str
    sectors: int
    mnt: Path

    @property
    def dev(self) -> str:
        return f"/dev/mapper/{self.name}"

    def table(self, drop: bool) -> str:
        """xfstests' FLAKEY_DROP_WRITES / FLAKEY_ALLOW_WRITES tables."""
        return (f"0 {self.sectors} flakey {self.loop} 0 0 180 1 drop_writes" if drop
                else f"0 {self.sectors} flakey {self.loop} 0 180 0")

    def load(self, drop: bool) -> None:
        """Switch tables without flushing: I/O in flight meets the new table (xfstests' _load_flakey_table)."""
        for cmd in (("suspend", "--nolockfs", "--noflush", self.name), ("load", self.name, "--table", self.table(drop)),
                    ("resume", self.name)):
            done = sh("dmsetup", *cmd)
            assert done.returncode == 0, f"dmsetup {' '.join(cmd)}: {done.stderr}"

    def mount(self) -> None:
        """Mount the device again: ext4 replays its journal, as after a reboot."""
        done = sh("mount", self.dev, self.mnt)
        assert done.returncode == 0, done.stderr

    def unmount(self) -> None:
        """Unmount (while writes are dropped, whatever it flushes is lost too)."""
        for _ in range(4):
            if not os.path.ismount(self.mnt) or sh("umount", self.mnt).returncode == 0:
                return
            time.sleep(0.5)
        assert not os.path.ismount(self.mnt), f"cannot unmount {self.mnt}"


@pytest.fixture
def flakey(tmp_path: Path) -> Iterator[Flakey]:
    """A fresh 256 MiB ext4 on dm-flakey (writes allowed); removed at the end."""
    missing = dm_flakey_missing()
    if missing:
        pytest.skip(missing)
    img = tmp_path / "fs.img"
    with img.open("wb") as f:
        f.truncate(256 << 20)
    attached = sh("losetup", "-f", "--show", img)
    if attached.returncode != 0:
        pytest.skip(f"no loop device: {attached.stderr.strip()}")
    loop = attached.stdout.strip()
    fs = Flakey(f"ds-flakey-{os.getpid()}-{random.getrandbits(32):08x}", loop,
                int(sh("blockdev", "--getsz", loop).stdout), tmp_path / "mnt")
    fs.mnt.mkdir()
    try:
        created = sh("dmsetup", "create", fs.name, "--table", fs.table(drop=False))
        assert created.returncode == 0, created.stderr
        assert sh("mkfs.ext4", "-q", "-F", fs.dev).returncode == 0
        fs.mount()
        yield fs
    finally:
        sh("dmsetup", "resume", fs.name)  # a switch that failed half-way must not leave the device suspended
        fs.unmount()
        for _ in range(10):  # udev may hold the device a moment
            if sh("dmsetup", "remove", fs.name).returncode == 0 or fs.name not in sh("dmsetup", "ls").stdout:
                break
            time.sleep(0.5)
        sh("losetup", "-d", loop)


def test_dm_flakey_drops_unflushed_writes(flakey: Flakey, tmp_path: Path) -> None:
    """At a random point the device drops every write; what it kept still keeps I1, I2, I4 and I5."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    step, delay = rng.randrange(1, len(TAGS)), rng.uniform(0, 0.3)
    root = flakey.mnt / "ckpt"
    root.mkdir()
    factory = DaemonFactory(tmp_path)
    dropped_at: list[float] = []
    switched: list[bool] = []

    def cut() -> None:
        dropped_at.append(time.time())  # before the switch: what resolved earlier reached the device
        flakey.load(drop=True)
        switched.append(True)

    def before(k: int, commits: list[Commit]) -> None:
        if k == step:
            deadline = time.monotonic() + 120  # a hang guard: at least one commit resolves before the cut
            while all(c.resolved == math.inf for c in commits) and time.monotonic() < deadline:
                time.sleep(0.01)
            timer.start()

    timer = threading.Timer(delay, cut)
    try:
        d = factory.start(storage={"roots": [str(root)]}, **SMALL)
        with Client(d.endpoint, timeout=60) as c:
            commits = run_workload(c, root / RUN, before)
            timer.join()
        assert switched, "dmsetup could not switch the table to drop_writes (see the log of the timer thread)"
        d.proc.kill()  # the power is off: nothing more reaches the disk, and nothing runs
        d.proc.wait()
        flakey.unmount()
        flakey.load(drop=False)
        flakey.mount()
        resolved = [c for c in commits if c.resolved < dropped_at[0]]
        where = f"(seed {seed}: cut {delay:.2f} s into step {step}; resolved before: {[c.ordinal for c in resolved]})"
        try:
            check_invariants(root / RUN, resolved, Verdicts(commits))
        except AssertionError as exc:
            raise AssertionError(f"{exc} {where}") from None
        assert resolved, f"the cut came before any commit resolved {where}"
    finally:
        timer.cancel()
        factory.stop_all()


# -- (b) the strace log, replayed at every crash point -----------------------------------------


@dataclass
class Call:
    """One traced system call that returned: its arguments as strace printed them, and the bytes it wrote."""

    name: str
    args: list[str]
    ret: int
    entry: int
    """The log line where it started: an fsync covers what returned before."""
    exit: int
    t_entry: float
    t_exit: float
    line: str
    data: bytearray = field(default_factory=bytearray)
    node: Node | None = None
    """What an open found or made as it began."""


_HEAD = re.compile(r"(?P<tid>\d+)\s+(?P<ts>\d+\.\d+) (?P<body>.*)")
_END = r"\)\s+= (?P<ret>-?\d+|0x[0-9a-f]+|\?)(?P<rest>.*?)(?: <(?P<dur>\d+\.\d+)>)?"
_DONE = re.compile(r"(?P<name>\w+)\((?P<args>.*)" + _END)
_UNFINISHED = re.compile(r"(?P<name>\w+)\((?P<args>.*) <unfinished \.\.\.>")
_RESUMED = re.compile(r"<\.\.\. (?P<name>\w+) resumed>(?P<args>.*)" + _END)
_DUMP = re.compile(r" \| (?P<off>[0-9a-f]{5,})  (?P<hex>.{1,48})")
_FD = re.compile(r"(?P<fd>-?\d+|AT_FDCWD)(?:<(?P<path>.*)>)?(?:\(deleted\))?")


def split_args(text: str) -> list[str]:
    """strace's argument list split at top-level commas (not inside strings, <paths>, [arrays] or {structs})."""
    out, cur, depth, quoted, escaped = [], [], 0, False, False
    for ch in text:
        if quoted:
            quoted = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            quoted = True
        elif ch in "<[{(":
            depth += 1
        elif ch in ">]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    return out + ["".join(cur).strip()]


def unquote(token: str) -> str:
    """A path argument as strace printed it ("..." with C escapes)."""
    body = token[token.index('"') + 1: token.rindex('"')]
    return os.fsdecode(codecs.decode(body, "unicode_escape").encode("latin-1"))


def parse_strace(log: Path) -> list[Call]:
    """The completed calls of ``strace -f -ttt -T -y -e write=all``, in the order they returned."""
    calls: list[Call] = []
    started: dict[str, tuple[int, str, str, float, str]] = {}
    last: Call | None = None
    for i, line in enumerate(log.read_text(errors="surrogateescape").splitlines()):
        dump = _DUMP.match(line)
        if dump:
            assert last is not None and int(dump["off"], 16) == len(last.data), f"line {i + 1}: a stray dump: {line}"
            last.data += bytes.fromhex(dump["hex"].replace(" ", ""))
            continue
        head = _HEAD.fullmatch(line)
        last = None
        if head is None:
            continue
        tid, ts, body = head["tid"], float(head["ts"]), head["body"]
        if m := _UNFINISHED.fullmatch(body):
            started[tid] = (i, m["name"], m["args"], ts, line.removesuffix(" <unfinished ...>"))
            continue
        if m := _RESUMED.fullmatch(body):
            if tid not in started:
                continue  # began before the trace did
            entry, name, args, t0, began = started.pop(tid)
            args += m["args"]
            line = began + body[body.index(">") + 1:]
        elif m := _DONE.fullmatch(body):
            entry, name, args, t0 = i, m["name"], m["args"], ts
        else:
            continue  # signals, exits
        if m["ret"] == "?" or m["ret"].startswith("0x"):
            continue
        t_exit = max(ts, t0 + float(m["dur"] or 0))
        last = Call(name, split_args(args), int(m["ret"]), entry, i, t0, t_exit, line)
        calls.append(last)
    for call in calls:
        if call.name in ("write", "pwrite64") and call.ret > 0:
            assert len(call.data) == call.ret, f"strace dumped {len(call.data)} of {call.ret} bytes: {call.line}"
    return calls


class Node:
    """A file or folder as a crash would find it: entries and bytes now, and the part of them made durable."""

    def __init__(self, is_dir: bool) -> None:
        self.is_dir = is_dir
        self.live: dict[str, Node] = {}
        self.kept: dict[str, Node] = {}
        self.pending: list[tuple[int, str, Node | None]] = []
        """Entry changes not yet durable: (the line it returned on, name, the node or None for a removal)."""
        self.writes: list[tuple[int, int, bytes | int]] = []
        """(line, offset, bytes) or (line, -1, new size): every write, in the order they returned."""
        self.synced = 0
        """How many of ``writes`` are durable."""

    def sync(self, entry: int) -> None:
        """An fsync that started on line ``entry``: what returned before it is durable."""
        if self.is_dir:
            done = [p for p in self.pending if p[0] < entry]
            self.pending = [p for p in self.pending if p[0] >= entry]
            for _, name, node in done:
                if node is None:
                    self.kept.pop(name, None)
                else:
                    self.kept[name] = node
        else:
            while self.synced < len(self.writes) and self.writes[self.synced][0] < entry:
                self.synced += 1

    def content(self, durable: bool) -> bytes:
        """The file's bytes after its durable writes (or all of them): as long as the furthest write reached."""
        buf = bytearray()
        for _, offset, data in self.writes[: self.synced if durable else len(self.writes)]:
            if offset < 0:
                del buf[data:]
                buf.extend(bytes(max(0, data - len(buf))))
            else:
                buf.extend(bytes(max(0, offset + len(data) - len(buf))))
                buf[offset: offset + len(data)] = data
        return bytes(buf)


Tree = dict[str, bytes | None]
"""A crash state: path below the root → the file's bytes, or None for a folder."""


class Replay:
    """The traced calls applied to a model of the root's file system, one at a time."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.normpath(root)
        self.top = Node(True)  # made before the daemon started: durable, and empty
        self.nodes = [self.top]
        self.fds: dict[int, Node] = {}
        self.pos: dict[int, int] = {}

    def _inside(self, path: str) -> bool:
        return path == self.root or path.startswith(self.root + "/")

    def _fd(self, token: str) -> tuple[Node | None, str]:
        """The node an fd argument refers to (None outside the root); fails on a root file the replay never saw opened."""
        m = _FD.fullmatch(token)
        assert m, f"not an fd: {token}"
        path = m["path"] or ""
        node = self.fds.get(int(m["fd"])) if m["fd"] != "AT_FDCWD" else None
        assert node is not None or not self._inside(path), f"an fd of {path} the replay never saw opened"
        return node, path

    def _place(self, dirfd: str, name_token: str) -> tuple[Node, str] | None:
        """(parent folder, name) that ``dirfd`` + path name, or None outside the root; (top, "") for the root itself."""
        name = unquote(name_token)
        node, base = self._fd(dirfd) if not os.path.isabs(name) else (None, "")
        if node is None:
            full = os.path.normpath(os.path.join(base, name))
            if not self._inside(full):
                return None
            node, name = self.top, os.path.relpath(full, self.root)
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if not parts:
            return self.top, ""
        for part in parts[:-1]:
            assert part in node.live, f"{name}: no folder {part!r} there in the replay"
            node = node.live[part]
        return node, parts[-1]

    def _find(self, dirfd: str, name_token: str) -> tuple[bool, Node | None]:
        """Whether the path is under the root, and what is there now (None: nothing, or not yet in the replay)."""
        try:
            place = self._place(dirfd, name_token)
        except AssertionError:
            return True, None  # a folder whose mkdir has not begun in the log yet
        if place is None:
            return False, None
        return True, place[0].live.get(place[1]) if place[1] else self.top

    def _change(self, call: Call, parent: Node, name: str, node: Node | None) -> None:
        """Name ``node`` (None: nothing) ``name`` in ``parent`` now; durable once ``parent`` is fsynced after ``call``."""
        if node is None:
            del parent.live[name]
        else:
            parent.live[name] = node
        parent.pending.append((call.exit, name, node))

    def begin(self, call: Call) -> bool:
        """What a call does to folders, applied as it starts (another thread may see it before it returns); whether
        it changed an entry. Only durability waits for the return: a change is covered by an fsync started after it."""
        if call.ret < 0:
            return False
        a, name = call.args, call.name
        if name == "close":  # frees the fd as it starts: another thread may get the number back first
            self.fds.pop(int(_FD.fullmatch(a[0])["fd"]), None)
            return False
        if name in ("open", "openat", "creat"):
            flags = _open_flags(call)
            if "O_CREAT" not in flags:
                return False  # looked up as it returns
            place = self._place("AT_FDCWD", a[0]) if name != "openat" else self._place(a[0], a[1])
            assert "O_APPEND" not in flags or place is None, f"O_APPEND is not modeled: {call.line}"
            if place is None:
                return False
            call.node = place[0].live.get(place[1]) if place[1] else self.top
            if call.node is None:
                call.node = self._new(call, *place, is_dir=False)
                return True
            if "O_TRUNC" in flags and call.node.writes:
                call.node.writes.append((call.exit, -1, 0))
            return False
        if name in ("rename", "renameat", "renameat2"):
            src = self._place("AT_FDCWD", a[0]) if name == "rename" else self._place(a[0], a[1])
            dst = self._place("AT_FDCWD", a[1]) if name == "rename" else self._place(a[2], a[3])
            if src is None and dst is None:
                return False
            assert src is not None and dst is not None, f"a rename across the root's edge: {call.line}"
            node, other = src[0].live[src[1]], dst[0].live.get(dst[1])
            if name == "renameat2" and "RENAME_EXCHANGE" in a[4]:
                self._change(call, *src, other)
            elif src != dst:
                self._change(call, *src, None)
            self._change(call, *dst, node)
            return True
        if name in ("unlink", "unlinkat", "rmdir"):
            place = self._place(a[0], a[1]) if name == "unlinkat" else self._place("AT_FDCWD", a[0])
            if place is not None:
                self._change(call, *place, None)
            return place is not None
        if name in ("mkdir", "mkdirat"):
            place = self._place(a[0], a[1]) if name == "mkdirat" else self._place("AT_FDCWD", a[0])
            if place is not None:
                self._new(call, *place, is_dir=True)
            return place is not None
        return False

    def end(self, call: Call) -> bool:
        """What a call does to fds and bytes, applied as it returns; whether it flushed anything under the root."""
        if call.ret < 0:
            return False
        a, name = call.args, call.name
        if name in ("open", "openat", "creat"):
            self.fds.pop(call.ret, None)
            flags = _open_flags(call)
            if call.node is None:
                inside, call.node = self._find("AT_FDCWD", a[0]) if name != "openat" else self._find(a[0], a[1])
                if call.node is None:  # a path another thread is still making or removing: only ever read
                    assert not inside or flags.startswith("O_RDONLY"), f"an untracked root file: {call.line}"
                    return False
                if "O_TRUNC" in flags and call.node.writes:
                    call.node.writes.append((call.exit, -1, 0))
            self.fds[call.ret], self.pos[call.ret] = call.node, 0
            return False
        if name in ("dup", "dup2", "dup3") or (name == "fcntl" and a[1].startswith("F_DUPFD")):
            node, _ = self._fd(a[0])
            self.fds.pop(call.ret, None)
            if node is not None:
                self.fds[call.ret], self.pos[call.ret] = node, 0
            return False
        if name in ("write", "pwrite64"):
            node, _ = self._fd(a[0])
            if node is not None:
                fd = int(_FD.fullmatch(a[0])["fd"])
                offset = int(a[3]) if name == "pwrite64" else self.pos[fd]
                self.pos[fd] += 0 if name == "pwrite64" else call.ret
                node.writes.append((call.exit, offset, bytes(call.data)))
            return False
        if name in ("ftruncate", "truncate"):
            node = self._fd(a[0])[0] if name == "ftruncate" else self._find("AT_FDCWD", a[0])[1]
            if node is not None:
                node.writes.append((call.exit, -1, int(a[1])))
            return False
        if name in ("fsync", "fdatasync"):
            node, _ = self._fd(a[0])
            if node is not None:
                node.sync(call.entry)
            return node is not None
        if name in ("sync", "syncfs"):
            for node in self.nodes:
                node.sync(call.entry)
            return True
        if name in ("writev", "pwritev", "pwritev2", "fallocate", "copy_file_range", "sendfile", "link", "linkat",
                    "symlink", "symlinkat"):
            assert self.root not in call.line, f"the replay does not model {name} under the root: {call.line}"
        return False  # sync_file_range flushes nothing a crash must keep

    def _new(self, call: Call, parent: Node, name: str, is_dir: bool) -> Node:
        """A file or folder ``call`` makes: its entry is as durable as any other change of ``parent``."""
        node = Node(is_dir)
        self.nodes.append(node)
        self._change(call, parent, name, node)
        return node

    def tree(self, entries: str, durable: bool) -> Tree:
        """The root as a crash leaves it: entries "kept" (fsynced) or "live" (all), bytes durable or all."""
        out: Tree = {}

        def walk(node: Node, rel: str, above: frozenset[int]) -> None:
            for name, child in sorted(getattr(node, entries).items()):
                path = f"{rel}/{name}" if rel else name
                if not child.is_dir:
                    out[path] = child.content(durable)
                elif id(child) not in above:  # a folder under two names (a half-durable rename): once each
                    out[path] = None
                    walk(child, path, above | {id(child)})

        walk(self.top, "", frozenset({id(self.top)}))
        return out


def _open_flags(call: Call) -> str:
    """An open's flags as strace printed them (creat has none of its own)."""
    return "O_CREAT|O_WRONLY|O_TRUNC" if call.name == "creat" else call.args[2 if call.name == "openat" else 1]


def write_tree(tree: Tree, dest: Path) -> None:
    """Make ``dest`` hold exactly ``tree``."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for rel, data in sorted(tree.items()):
        if data is None:
            (dest / rel).mkdir()
        else:
            (dest / rel).write_bytes(data)


def read_tree(root: Path) -> Tree:
    """``root`` as a Tree, to hold the replay against what is really on disk."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


@dataclass
class CrashState:
    """One crash state to check: how it was reached, the commits resolved by then, and the files."""

    label: str
    resolved: list[Commit]
    tree: Tree


@dataclass
class TracedRun:
    """A run of the workload under strace: what the client saw, the calls, the crash states and the last one."""

    root: Path
    commits: list[Commit]
    calls: list[Call]
    states: list[CrashState]
    final: Tree
    """What a crash at the very end keeps."""
    work: Path


def crash_states(root: Path, calls: list[Call], commits: list[Commit]) -> tuple[list[CrashState], Replay]:
    """Replay ``calls``; the distinct crash states at every fsync, entry change and resolved commit, and the end."""
    replay = Replay(root)
    states: list[CrashState] = []
    seen: set[tuple[str, int]] = set()

    def take(label: str, t: float, kinds: tuple[str, ...]) -> None:
        resolved = [c for c in commits if c.resolved <= t]
        for kind in kinds:
            tree = replay.tree("kept" if kind == "kept" else "live", durable=True)
            digest = hashlib.sha1(repr(sorted((p, d if d is None else hashlib.sha1(d).digest())
                                              for p, d in tree.items())).encode()).hexdigest()
            if (digest, len(resolved)) not in seen:
                seen.add((digest, len(resolved)))
                states.append(CrashState(f"{kind} state {label}", resolved, tree))

    resolutions = sorted(c.resolved for c in commits)
    steps = sorted([(c.entry, 0, c) for c in calls] + [(c.exit, 1, c) for c in calls], key=lambda s: s[:2])
    for line, ending, call in steps:
        t = call.t_exit if ending else call.t_entry
        while resolutions and t > resolutions[0]:
            r = resolutions.pop(0)
            take(f"when a commit resolved (t={r:.6f}, before log line {line + 1})", r, ("kept", "metadata first"))
        if ending and replay.end(call):
            take(f"after log line {line + 1}: {call.line.strip()[:240]}", t, ("kept", "metadata first"))
        elif not ending and replay.begin(call):
            take(f"as log line {line + 1} began: {call.line.strip()[:240]}", t, ("metadata first",))
    take("at the end of the run", math.inf, ("kept", "metadata first"))
    return states, replay


STRACE = ["strace", "-f", "-ttt", "-T", "-y", "--seccomp-bpf", "-e", f"trace={TRACED}", "-e", "write=all"]


def strace_missing() -> str | None:
    """Why strace cannot trace the daemon here, or None."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    probe = sh(*STRACE, "-o", os.devnull, "true")
    if probe.returncode != 0:
        return f"strace cannot trace here (ptrace restricted, or too old): {probe.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedRun]:
    """One run of the workload against a daemon under strace, its log parsed and replayed."""
    missing = strace_missing()
    if missing:
        pytest.skip(missing)
    work = tmp_path_factory.mktemp("power")
    sockdir = Path(tempfile.mkdtemp(prefix="ds-"))  # short, 0700: the socket's folder
    root, log, trace = work / "ckpt", work / "datastatesd.log", work / "strace.log"
    root.mkdir()
    cfg = {"endpoint": f"ipc://{sockdir}/d.sock", "storage": {"roots": [str(root)]}, "log_level": "info", **SMALL}
    config = work / "node.yaml"
    config.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([*STRACE, "-o", str(trace), DATASTATESD, "--node-config", str(config)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    pid = 0
    try:
        wait_ready(cfg["endpoint"], proc, log)
        with Client(cfg["endpoint"], timeout=60) as c:
            pid = c.status()["daemon"]["pid"]
            commits = run_workload(c, root / RUN)
        os.kill(pid, signal.SIGTERM)  # a clean stop: strace then writes out its log
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # the daemon first: a killed strace would leave it running
            for target in (pid, proc.pid):
                if target:
                    os.kill(target, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(sockdir, ignore_errors=True)
    calls = parse_strace(trace)
    states, replay = crash_states(root, calls, commits)
    assert replay.tree("live", durable=False) == read_tree(root), (
        "the replay of the whole log differs from the root on disk: a file-system call escaped the trace")
    yield TracedRun(root, commits, calls, states, replay.tree("kept", durable=True), work)


def test_every_crash_point_of_a_traced_run_keeps_the_invariants(traced: TracedRun) -> None:
    """Replayed at every fsync, entry change and resolved commit, the daemon's own calls keep I1, I2, I4 and I5."""
    assert all(c.resolved < math.inf for c in traced.commits)
    verdicts = Verdicts(traced.commits)
    failures: list[str] = []
    scratch = traced.work / "crash"
    for state in traced.states:
        write_tree(state.tree, scratch)
        run = scratch / RUN
        try:
            if run.is_dir():
                check_invariants(run, state.resolved, verdicts)
            else:
                assert not state.resolved, f"I2: {len(state.resolved)} commit(s) had resolved, and the run folder is lost"
        except AssertionError as exc:
            failures.append(f"{state.label}, {len(state.resolved)} commit(s) resolved: {str(exc).splitlines()[0]}")
    assert not failures, f"{len(failures)} of {len(traced.states)} crash states break an invariant; first ones:\n" + \
        "\n".join(failures[:6])
    assert sum(c.name in ("fsync", "fdatasync") for c in traced.calls) >= 4 * len(TAGS), "the trace shows no fsyncs"
    write_tree(traced.final, scratch)  # the end: every commit durable, every tag at its last version
    assert check_invariants(scratch / RUN, traced.commits, verdicts) == {"s1": 0, "s2": 2, "s3": 4, "last": 5}


def boot_time() -> float:
    with open("/proc/stat") as f:
        return next(float(line.split()[1]) for line in f if line.startswith("btime "))


def test_the_next_daemon_removes_what_a_power_loss_left(traced: TracedRun, tmp_path: Path) -> None:
    """I5: a daemon started after the power came back removes the temp files and staging folders, and nothing else."""
    def left(state: CrashState) -> int:
        return sum(p.endswith((TEMP_SUFFIX, STAGING_SUFFIX)) for p in state.tree)

    state = max(traced.states, key=left)
    assert left(state) > 0, "no crash state holds a temp file or a staging folder"
    root = tmp_path / "ckpt"
    write_tree(state.tree, root)
    verdicts = Verdicts(traced.commits)
    before = check_invariants(root / RUN, state.resolved, verdicts)
    for owner in {o for path in state.tree for o in re.findall(r"\.([0-9a-f]{16})-", path)}:
        # A reboot empties /dev/shm: the dead daemon's lock file (docs/reliability.md, I5) is gone with it...
        Path(SHM_DIR, f"datastates-{os.geteuid()}-daemons", f"{owner}.lock").unlink(missing_ok=True)
    before_boot = boot_time() - 60  # ...and everything under the root was last changed before the boot
    for path in [root, *root.rglob("*")]:
        os.utime(path, (before_boot, before_boot), follow_symlinks=False)
    factory = DaemonFactory(tmp_path)
    try:
        d = factory.start(storage={"roots": [str(root)]}, **SMALL)
        with Client(d.endpoint, timeout=60) as c:
            removed = c.status()["daemon"]["leftovers_removed"]
        assert leftovers(root) == [], f"{state.label}: left after a restart: {leftovers(root)}; status: {removed}"
        assert check_invariants(root / RUN, state.resolved, verdicts) == before
    finally:
        factory.stop_all()
