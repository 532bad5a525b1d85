"""Real daemons for the tests: each fixture starts a `datastatesd` process on its own endpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pwd
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
import yaml
import zmq

from datastates.client.connection import Connection
from datastates.protocol import messages as m
from datastates.protocol.errors import DaemonNotRunning, DaemonUnavailable
from datastates.protocol.version import PROTOCOL_VERSION

BIN = Path(sys.executable).parent
DATASTATESD = str(BIN / "datastatesd")
DATASTATESCTL = str(BIN / "datastatesctl")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=os.environ.get("DATASTATES_LONG", "") not in ("", "0"),
                     help="run the randomized and kill -9 loops at their full size (also: DATASTATES_LONG=1); "
                          "without it they run at a smaller size, as `make test` does")


@pytest.fixture(scope="session")
def long_runs(pytestconfig: pytest.Config) -> bool:
    """Whether the long randomized runs go at their full size (``--long``) or at the smaller default."""
    return bool(pytestconfig.getoption("--long"))


@dataclass
class DaemonProc:
    """A running datastatesd: its endpoint, the root it may write, its config and log."""

    endpoint: str
    root: Path
    config: Path
    log: Path
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [DATASTATESCTL, "--endpoint", self.endpoint, *args], capture_output=True, text=True, timeout=timeout
        )

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def stacks(self, timeout: float = 10) -> str:
        """Every thread's and task's stack, as the daemon logs them on SIGUSR2: what a hang guard shows of a daemon
        that seems stuck (its end of the log, at most 30,000 characters)."""
        start = len(self.log_text())
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while "SIGUSR2:" not in self.log_text()[start:] and time.monotonic() < deadline and self.proc.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # the rest of the record
        return self.log_text()[start:][:30_000]


def wait_ready(endpoint: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    conn = Connection(endpoint)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"datastatesd exited with {proc.returncode}:\n{log.read_text()}")
            try:
                conn.call(m.Status(), 0.5)
                return
            except DaemonNotRunning:  # not listening yet: said at once, so pace the loop
                time.sleep(0.05)
            except DaemonUnavailable:
                continue
        raise RuntimeError(f"datastatesd not ready after {timeout} s:\n{log.read_text()}")
    finally:
        conn.close()


CAP_SYS_RESOURCE = 24
"""linux/capability.h: what lets a process raise its hard limits."""


def drop_capability(cap: int) -> None:
    """Remove ``cap`` from this process's bounding set: a program it execs then never holds it, even as root."""
    import ctypes

    PR_CAPBSET_DROP = 24
    if ctypes.CDLL(None, use_errno=True).prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


class DaemonFactory:
    """Starts datastatesd processes whose files live under ``tmp`` and stops them all at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[DaemonProc] = []
        self._spawned = 0
        self.sockdir = tempfile.mkdtemp(prefix="ds-")  # short: unix socket paths are limited to ~107 bytes

    def start(self, **overrides: Any) -> DaemonProc:
        (d,) = self.start_many(overrides)
        return d

    def start_many(self, *overrides: dict[str, Any]) -> list[DaemonProc]:
        """One daemon per mapping of overrides, started side by side: their start-ups (mostly importing torch) overlap."""
        spawned = [self._spawn(**o) for o in overrides]
        started = [DaemonProc(endpoint=cfg["endpoint"], root=self.tmp / "ckpt", config=config, log=log, proc=proc)
                   for cfg, config, log, proc in spawned]
        self.started.extend(started)  # stopped at the end even if one of them fails to come up
        for d in started:
            wait_ready(d.endpoint, d.proc, d.log)
        return started

    def _spawn(self, nofile: tuple[int, int] | None = None, unprivileged: bool = False, output: int | None = None,
               **overrides: Any) -> tuple[dict[str, Any], Path, Path, subprocess.Popen]:
        """``nofile``: the daemon's open-files limits, (soft, hard), as ``ulimit -Sn`` and ``-Hn`` in a job script;
        ``unprivileged``: without CAP_SYS_RESOURCE, as a user's daemon runs, even when the tests run as root;
        ``output``: a descriptor its log goes to instead of its log file (a pipe the test holds: a log that blocks)."""
        n = self._spawned
        self._spawned += 1
        root = self.tmp / "ckpt"
        root.mkdir(exist_ok=True)
        cfg = {
            "endpoint": f"ipc://{self.sockdir}/d{n}/datastatesd.sock",
            "storage": {"roots": [str(root)]},
            "host_memory": "64MiB",
            "chunk_size": "4MiB",
            "log_level": "debug",
        }
        cfg.update(overrides)
        config = self.tmp / f"node{n}.yaml"
        config.write_text(yaml.safe_dump(cfg))
        log = self.tmp / f"datastatesd{n}.log"

        def limit() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
            if unprivileged and os.geteuid() == 0:
                drop_capability(CAP_SYS_RESOURCE)

        proc = subprocess.Popen([DATASTATESD, "--node-config", str(config)],
                                stdout=log.open("w") if output is None else output, stderr=subprocess.STDOUT,
                                preexec_fn=limit)
        return cfg, config, log, proc

    def signal_all(self) -> None:
        """SIGTERM to every daemon still running, all at once, so that their drains overlap."""
        for d in self.started:
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)

    def stop_all(self) -> None:
        """Stop every daemon, wait until each has exited, and remove what each left in /dev/shm.

        A stopped daemon keeps its lock file, and a killed one its replica folder too, for the
        next daemon on the same roots to prove it dead and clean up after it (daemon/instances.py).
        No later daemon ever covers a test's roots, so those files would stay a week: they go here.
        """
        self.signal_all()
        for d in self.started:
            d.stop()
            owner = re.search(r" owner ([0-9a-f]{16}),", d.log_text())
            if owner is not None:
                shutil.rmtree(SHM / f"datastates-{os.geteuid()}-{owner.group(1)}", ignore_errors=True)
                for leftover in DAEMON_LOCKS.glob(f"{owner.group(1)}.*"):  # its lock, its upload journal
                    with contextlib.suppress(FileNotFoundError):
                        leftover.unlink()
        shutil.rmtree(self.sockdir, ignore_errors=True)

    def stop_all_later(self) -> None:
        """SIGTERM every daemon now; they exit during the next tests, and are waited for by ``reap``.

        A drain takes over a second even with nothing pending (the daemon's DRAIN_GRACE), so a
        test that does not need its daemons gone before it ends lets them drain in the background.
        """
        self.signal_all()
        _STOPPING.append(self)
        reap(block=False)


_STOPPING: list[DaemonFactory] = []
"""Factories whose daemons were sent SIGTERM and may still be draining."""


def reap(block: bool = True) -> None:
    """Wait for the daemons ``stop_all_later`` left draining (only those that have exited, unless ``block``)."""
    for factory in list(_STOPPING):
        if block or all(d.proc.poll() is not None for d in factory.started):
            factory.stop_all()  # SIGTERM was sent: this waits (and kills one that hangs past its timeout)
            _STOPPING.remove(factory)


SHM = Path("/dev/shm")
DAEMON_LOCKS = SHM / f"datastates-{os.geteuid()}-daemons"
"""Where each running daemon holds its lock (daemon/instances.py)."""
PROJECT_SHM = re.compile(rf"torch_.*|datastates-{os.geteuid()}-.*|ds-test-.*")
"""What the project and its tests name in /dev/shm: the clients' segments (torch names them, client/shm.py), the
clients' decision folders (protocol/outcome.py), the daemons' replica folders and lock folder (daemon/replica/folder.py,
daemon/instances.py), and the tests' own folders."""
_SHM_BEFORE: set[str] = set()
"""What /dev/shm held when the session started: another user's or job's, never removed."""
_LOCKS_BEFORE: set[str] = set()
"""The daemon lock files there when the session started."""
_TORCH_DIRS_BEFORE: set[str] = set()
"""The torch_shm_manager socket folders in the temporary folder when the session started."""


def _torch_manager_dirs() -> set[str]:
    """The folders torch_shm_manager makes for its socket (torch's ``file_system`` sharing, ``cpu_capture="shm"``)."""
    return {str(p) for p in Path(tempfile.gettempdir()).glob("torch-shm-dir-*")}


def pytest_sessionstart(session: pytest.Session) -> None:
    if SHM.is_dir():
        _SHM_BEFORE.update(p.name for p in SHM.iterdir())
    if DAEMON_LOCKS.is_dir():
        _LOCKS_BEFORE.update(p.name for p in DAEMON_LOCKS.iterdir())
    _TORCH_DIRS_BEFORE.update(_torch_manager_dirs())


def _shm_in_use() -> set[str]:
    """Every /dev/shm path a process of this node maps or holds open, whatever its pid namespace.

    torch names a segment after its maker's pid, but a trainer in a pid namespace of its own
    is pid 1 there: only who maps a segment tells whether it is still used.
    """
    used: set[str] = set()
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/dev/shm/" in line)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        used.add(target)
    return used


def _lock_held(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _maker_alive(name: str, in_use: set[str], basetemp: Path) -> bool:
    """Whether what made /dev/shm/``name`` still runs, or is another test session's to judge: then it stays.

    A torch segment is alive while a process maps or holds it (``in_use``); a decision
    folder (datastates-<uid>-client-<pid>-...) names its process; a replica folder names
    its daemon, whose lock is held while it runs, and whose lock file names its roots: a killed
    daemon of another session beside this one leaves its replica folder for that session's
    next daemon to remove (a test checks it does); the daemons' lock folder stays while any daemon runs.
    """
    if name.startswith("torch_"):
        return str(SHM / name) in in_use
    pid = re.match(rf"datastates-{os.geteuid()}-client-(\d+)-", name)
    if pid is not None:
        return Path(f"/proc/{pid.group(1)}").exists()
    owner = re.fullmatch(rf"datastates-{os.geteuid()}-([0-9a-f]{{16}})", name)
    if owner is not None:
        lock = DAEMON_LOCKS / f"{owner.group(1)}.lock"
        return _lock_held(lock) or (lock.exists() and not _lock_of_this_session(lock, basetemp))
    return name == DAEMON_LOCKS.name and any(_lock_held(lock) for lock in DAEMON_LOCKS.glob("*.lock"))


def _socket_alive(path: Path) -> bool:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _lock_of_this_session(lock: Path, basetemp: Path) -> bool:
    """Whether the daemon lock file ``lock`` names only roots under this pytest session's ``basetemp``: its daemon
    was one of this pytest session's. Another session's killed daemon's lock must stay, for its next daemon to prove
    it dead (I5): removed, that daemon could never clean up after it (the fault schedules of two sessions side by
    side did). A trainer's local saver (client/local_save.py) names the run folders it saved into, so its lock is told
    apart the same way (seed 230180: another session took a killed trainer's lock, and no daemon could remove its
    staging folder); one naming none saved nothing, and is taken as this pytest session's, as it started after."""
    try:
        roots = [r for r in lock.read_text().split("\n") if r]
    except OSError:
        return False
    return all(Path(r).is_relative_to(basetemp) for r in roots)


def _leftovers(basetemp: Path) -> list[Path]:
    """What this pytest session's tests left behind that no running process uses: in /dev/shm (segments, decision
    folders, replica folders, this pytest session's daemon locks) and in the temporary folder (dead
    torch_shm_managers' socket folders)."""
    left: list[Path] = []
    if SHM.is_dir():
        in_use = _shm_in_use()
        left += [p for p in SHM.iterdir() if p.name not in _SHM_BEFORE and PROJECT_SHM.fullmatch(p.name)
                 and _owned(p) and not _maker_alive(p.name, in_use, basetemp)]
    if DAEMON_LOCKS.is_dir() and DAEMON_LOCKS not in left:
        left += [p for p in DAEMON_LOCKS.iterdir()
                 if p.name not in _LOCKS_BEFORE and not _lock_held(p) and _lock_of_this_session(p, basetemp)]
    left += [Path(d) for d in sorted(_torch_manager_dirs() - _TORCH_DIRS_BEFORE)
             if not _socket_alive(Path(d) / "manager.sock")]
    return left


def _owned(path: Path) -> bool:
    """Whether ``path`` is this user's (another user's files are never this pytest session's to judge)."""
    try:
        return path.lstat().st_uid == os.geteuid()
    except OSError:
        return False


def _remove(path: Path) -> bool:
    """Whether ``path`` is gone now."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return True
    except OSError:
        pass
    return not os.path.lexists(path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop every daemon, then check that the tests left nothing behind: what they did is listed, then removed.

    A test that kills a trainer or a daemon with ``kill -9`` leaves what that process owned
    (its segments, its replicas); each such leftover is named here, so that a new leak is
    seen the day it comes. Anything that cannot be removed fails the session.
    """
    reap(block=True)
    left = _leftovers(session.config._tmp_path_factory.getbasetemp().resolve())
    if not left:
        return
    stuck = [p for p in left if not _remove(p)]
    kinds: dict[str, list[str]] = {}
    for p in left:
        kind = re.sub(r"[0-9a-f]{6,}|\d+|-[A-Za-z0-9]{6}$", "*", p.name)
        kinds.setdefault(f"{p.parent}/{kind}", []).append(p.name)
    report = [f"  {len(names):4d} x {pattern}  (e.g. {names[0]})" for pattern, names in sorted(kinds.items())]
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    say = tr.write_line if tr is not None else print
    say(f"\nleft behind by this pytest session's tests (or by another of this user's beside it), used by no process, "
        f"removed now ({len(left)}; kill -9 tests leave some):")
    for line in report:
        say(line)
    if stuck:
        say(f"could not remove {len(stuck)} of them: {[str(p) for p in stuck[:10]]}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    """The test's daemons, sent SIGTERM at teardown (see ``stop_all_later``)."""
    factory = DaemonFactory(tmp_path)
    yield factory
    factory.stop_all_later()


@pytest.fixture
def start_daemon(daemon_factory: DaemonFactory) -> Callable[..., DaemonProc]:
    """Factory: start_daemon(**node_yaml_overrides) -> DaemonProc, stopped at teardown."""
    return daemon_factory.start


@pytest.fixture
def start_daemons(daemon_factory: DaemonFactory) -> Callable[..., list[DaemonProc]]:
    """Factory: start_daemons(overrides, overrides, ...) -> one DaemonProc per mapping, started side by side."""
    return daemon_factory.start_many


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProc]) -> DaemonProc:
    """One datastatesd with the test defaults."""
    return start_daemon()


@pytest.fixture
def client(daemon: DaemonProc) -> Iterator[Any]:
    from datastates.client import Client

    c = Client(daemon.endpoint, timeout=60)
    yield c
    c.close()


# -- shared across test modules ---------------------------------------------------------


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One datastatesd for a whole module, for the many small cases that need no daemon of their own."""
    factory = DaemonFactory(tmp_path_factory.mktemp("shared"))
    yield factory.start()
    factory.stop_all_later()


@pytest.fixture(scope="module")
def shared_client(shared_daemon: DaemonProc) -> Iterator[Any]:
    from datastates.client import Client

    c = Client(shared_daemon.endpoint, timeout=60)
    yield c
    c.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "own_daemon: in a module whose tests share one daemon (shared_daemon_folder), "
                                       "start a daemon of this test's own")
    config.addinivalue_line("markers", "heavy: one of the slowest tests (10 s or more); `make test` leaves it to CI, "
                                       "which sets DATASTATES_HEAVY=1 (so does --long)")


HEAVY = os.environ.get("DATASTATES_HEAVY", "") not in ("", "0")
"""Run the tests marked ``heavy``: CI does (.ci/run). Without it `make test` stays within 15 minutes on 2 cores."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HEAVY or config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="heavy (10 s or more): CI runs it; here with DATASTATES_HEAVY=1 or --long")
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(skip)


@pytest.fixture
def shared_daemon_folder(request: pytest.FixtureRequest) -> DaemonProc:
    """The module's shared daemon, seen with a storage folder of this test's own as its ``root``.

    For modules that override ``daemon`` with it: their tests need only a default daemon and
    their own paths and tags (no whole-status counts, no failed snapshots, which ``datastatesctl
    wait`` reports for the daemon's lifetime, no restart). A test marked ``own_daemon`` gets a
    fresh daemon instead, as ``daemon`` gives elsewhere.
    """
    if request.node.get_closest_marker("own_daemon"):
        return request.getfixturevalue("start_daemon")()
    shared: DaemonProc = request.getfixturevalue("shared_daemon")
    root = shared.root / re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")
    root.mkdir()
    return dataclasses.replace(shared, root=root)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh folder with a short path, for endpoints and runtime dirs this test makes itself."""
    path = Path(tempfile.mkdtemp(prefix="ds-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def save(client: Any, state: Any, path: str | os.PathLike, tag: str | None = None) -> Any:
    """Snapshot, wait and commit one file, the way a trainer does; returns the Committed reply."""
    handle = client.snapshot(state, path, tag=tag)
    client.wait()
    return client.commit(handle.tag).result(timeout=120)


def rank_client(d: DaemonProc, rank: int, world: int, local_world: int, nodes: int, job: str = "j1") -> Any:
    """A client of ``d`` as rank ``rank`` of a job of ``world`` ranks, ``local_world`` a node, on ``nodes`` nodes."""
    from datastates.client import Client
    from datastates.protocol.descriptors import Ranks

    ranks = Ranks(rank=rank, local_rank=rank % local_world, world_size=world, local_world_size=local_world,
                  node_rank=rank // local_world, num_nodes=nodes, job=job)
    return Client(d.endpoint, timeout=60, ranks=ranks)


def element_bytes(t: Any) -> Any:
    """The raw bytes of every element ``t`` views, as a uint8 tensor of shape ``t.shape + (itemsize,)``.

    Works for every dtype (sub-byte, float8, complex32...) and every stride, including 0,
    because it reinterprets the storage instead of asking the dtype for any arithmetic.
    """
    import torch

    isz = t.dtype.itemsize
    flat = torch.empty(0, dtype=torch.uint8)
    return flat.set_(
        t.untyped_storage(), t.storage_offset() * isz, [*t.shape, isz], [s * isz for s in t.stride()] + [1]
    )


def assert_tensor_bitwise(expected: Any, actual: Any, where: str = "tensor") -> None:
    """Same Python type, dtype, shape, stride, requires_grad and the very same bytes."""
    import torch

    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.stride() == expected.stride(), f"{where}: stride {actual.stride()} != {expected.stride()}"
    assert actual.requires_grad == expected.requires_grad, f"{where}: requires_grad {actual.requires_grad}"
    assert actual.device.type == "cpu", f"{where}: loaded onto {actual.device}"
    assert torch.equal(element_bytes(actual), element_bytes(expected)), f"{where}: bytes differ"


def assert_state_equal(expected: Any, actual: Any, where: str = "<root>") -> None:
    """Recursively equal: containers of the same type, tensors bitwise, numpy arrays bytewise, the rest by ==."""
    import numpy as np
    import torch

    if isinstance(expected, torch.Tensor):
        assert_tensor_bitwise(expected, actual, where)
        return
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert actual.tobytes() == expected.tobytes(), f"{where}: array bytes differ"
    elif isinstance(expected, dict):
        assert list(actual.keys()) == list(expected.keys()), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_state_equal(expected[k], actual[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length {len(actual)} != {len(expected)}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_state_equal(e, a, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def same_storage(a: Any, b: Any) -> bool:
    """Whether two tensors view one storage (what tied weights and views must keep after a load)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def addresses(module: Any) -> dict[str, int]:
    """Where each tensor of ``module``'s state dict lives: unchanged by a restore into its own tensors."""
    return {k: v.data_ptr() for k, v in module.state_dict().items()}


def watch_loads(module: Any) -> list[tuple[int, int]]:
    """For each later ``module.load_state_dict`` call (a framework's own), (how many tensors it is handed that are
    the module's own memory, how many tensors it is handed). A restore that read the file into the module's tensors
    hands only those, so the call's copies are of each tensor onto itself; a fresh load hands none."""
    import torch

    calls: list[tuple[int, int]] = []

    def seen(mod: Any, state_dict: dict[str, Any], *_: Any) -> None:
        own = addresses(mod)
        tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
        calls.append((sum(own.get(k) == v.data_ptr() for k, v in tensors.items()), len(tensors)))

    module.register_load_state_dict_pre_hook(seen)
    return calls


def sh(*cmd: str | os.PathLike) -> subprocess.CompletedProcess:
    return subprocess.run([os.fspath(c) for c in cmd], capture_output=True, text=True, timeout=60)


def at_first_open(path: str | re.Pattern[str], *commands: list[str] | Callable[[str], list[str]]
                  ) -> list[subprocess.CompletedProcess]:
    """Run ``commands`` (real processes, one after the other) the first time this process opens ``path``, before
    that open goes on: a window between a reader's choice of a file and its open, made certain. The results go in
    the list returned. An audit hook, which stays for good: inert once it ran.

    ``path`` may be a pattern the whole path must match (a name with a random part), and a command a function
    of the path opened."""
    ran: list[subprocess.CompletedProcess] = []

    def hook(event: str, args: tuple) -> None:
        if event != "open" or ran or not args or not isinstance(args[0], str):
            return
        if args[0] == path if isinstance(path, str) else path.fullmatch(args[0]):
            ran.append(subprocess.CompletedProcess([], -1))  # first: the opens of what runs come back through here
            ran[:] = [subprocess.run(cmd(args[0]) if callable(cmd) else cmd, capture_output=True, text=True, timeout=600)
                      for cmd in commands]

    sys.addaudithook(hook)
    return ran


@contextlib.contextmanager
def read_only(folder: Path) -> Iterator[None]:
    """``folder`` read-only for everyone while inside: a read-only bind mount of it onto itself."""
    bound = sh("mount", "--bind", folder, folder)
    if bound.returncode != 0:
        pytest.skip(f"mount --bind is not possible here: {bound.stderr.strip()}")
    try:
        ro = sh("mount", "-o", "remount,bind,ro", folder)
        assert ro.returncode == 0, ro.stderr
        yield
    finally:
        assert sh("umount", folder).returncode == 0, f"cannot drop the read-only bind mount of {folder}"


def mapped_files(d: DaemonProc, folder: str) -> list[str]:
    """The files under ``folder`` the daemon maps, each ending in " (deleted)" if it was removed since."""
    with open(f"/proc/{d.proc.pid}/maps") as f:
        return sorted({line.split(None, 5)[5].rstrip() for line in f if f" {folder}/" in line})


def removed_but_mapped(d: DaemonProc, folder: str, wait: float = 30) -> list[str]:
    """The removed files under ``folder`` the daemon still maps after up to ``wait`` seconds: it unlocks and unmaps
    a replica's pages on a thread of its own (daemon/replica/locks.py), moments after removing the file."""
    deadline = time.monotonic() + wait
    while True:
        removed = [m for m in mapped_files(d, folder) if m.endswith("(deleted)")]
        if not removed or time.monotonic() > deadline:
            return removed
        time.sleep(0.05)


def file_index(raw: bytes) -> tuple[Any, int, int, int]:
    """(header, where the index starts, the header's length, where the data region starts) of a checkpoint
    file's bytes, either format, as the reader finds them."""
    from datastates.protocol.format import (INDEX_AT, PREAMBLE_SIZE, data_offset, index_at, parse_header,
                                            parse_preamble, zip_layout)

    container, at = index_at(raw[:INDEX_AT], "file")
    version, header_len, header_hash = parse_preamble(raw[at:at + PREAMBLE_SIZE], "file", container)
    header = parse_header(raw[at + PREAMBLE_SIZE:at + PREAMBLE_SIZE + header_len], header_hash, "file")
    base = data_offset(header_len) if version == 1 else zip_layout(header, PREAMBLE_SIZE + header_len, version).data_offset
    return header, at, header_len, base


def with_index(raw: bytes, header: Any, data: bytes | None = None, pkl: bytes | None = None) -> bytes:
    """The format-2 file ``raw`` with ``header`` for its index (re-encoded, checksum and all), laid out again:
    its ``data.pkl`` (or ``pkl``) and its data region (or ``data``) kept, the central directory made for ``header``."""
    from datastates.protocol.format import DATA_ALIGN, INDEX_AT, INDEX_RECORD, PREAMBLE_SIZE, align_up, zip_layout
    from datastates.protocol.torchzip import Record, local_header

    old, _, header_len, base = file_index(raw)
    old_layout = zip_layout(old, PREAMBLE_SIZE + header_len)
    if pkl is None and old.torch_pkl:
        rec = old_layout.head[1]
        pkl = raw[rec.data_offset:rec.data_offset + rec.size]
    encoded = header.encode()
    body = raw[base:base + align_up(old.data_len, DATA_ALIGN)] if data is None else data
    try:
        layout = zip_layout(header, len(encoded))
    except (struct.error, ValueError):  # no zip can hold what it says (a negative size): the index, then the rest
        return local_header(Record(INDEX_RECORD, len(encoded), 0, INDEX_AT)) + encoded + raw[base:]
    return layout.head_bytes(encoded, pkl or b"") + body + layout.tail


def load_both(path: str | os.PathLike) -> Any:
    """``datastates.load(path)``, once plain ``torch.load`` (weights only, with and without ``mmap``) has read
    the same state from the same file, bitwise, and Python's ``zipfile`` has listed it (format 2)."""
    import warnings
    import zipfile

    import datastates
    import torch
    from datastates.protocol.format import PICKLE_RECORD
    from datastates.protocol.providers.pickled import training_globals

    ours = datastates.load(path)
    with warnings.catch_warnings(), torch.serialization.safe_globals(training_globals()):
        warnings.simplefilter("ignore")  # complex32 is "experimental"
        for mmap in (False, True):
            assert_state_equal(ours, torch.load(path, weights_only=True, mmap=mmap), f"torch.load(mmap={mmap})")
    with zipfile.ZipFile(path) as z:
        assert PICKLE_RECORD in z.namelist()
    return ours


def temp_files(root: Path) -> list[Path]:
    """Half-written files the daemon left behind under ``root``."""
    from datastates.protocol.format import TEMP_SUFFIX

    return sorted(p for p in root.rglob("*") if p.name.endswith(TEMP_SUFFIX))


def run_datastatesd(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                    timeout: float = 60) -> subprocess.CompletedProcess:
    """Run datastatesd to completion, for the cases where it must refuse to start; fails the test if it serves instead."""
    try:
        return subprocess.run([DATASTATESD, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"datastatesd {' '.join(args)} kept running (it should have refused to start): {exc.stderr}")


def run_datastatesd_many(argvs: dict[str, list[str]], timeout: float = 60,
                         workers: int = 4) -> dict[str, subprocess.CompletedProcess | subprocess.TimeoutExpired]:
    """``run_datastatesd`` for many cases side by side (each start-up is mostly importing torch), by case.

    A case whose daemon kept running gets its TimeoutExpired; ``refused_run`` fails that case's test.
    """
    with ThreadPoolExecutor(workers) as pool:
        futures = {case: pool.submit(subprocess.run, [DATASTATESD, *args], capture_output=True, text=True, timeout=timeout)
                   for case, args in argvs.items()}
    runs: dict[str, subprocess.CompletedProcess | subprocess.TimeoutExpired] = {}
    for case, fut in futures.items():
        try:
            runs[case] = fut.result()
        except subprocess.TimeoutExpired as exc:
            runs[case] = exc
    return runs


def refused_run(run: subprocess.CompletedProcess | subprocess.TimeoutExpired) -> subprocess.CompletedProcess:
    """A case of ``run_datastatesd_many``: fails the test if its daemon served instead of refusing to start."""
    if isinstance(run, subprocess.TimeoutExpired):
        pytest.fail(f"datastatesd {' '.join(map(str, run.cmd[1:]))} kept running (it should have refused to start): {run.stderr}")
    return run


class RawPeer:
    """A bare DEALER that sends whatever frames a test wants, as a buggy or foreign client would."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def send(self, frames: list[bytes], timeout_s: float = 30) -> tuple[dict, dict]:
        """Send ``frames``; the daemon's reply as (header, body)."""
        self._sock.send_multipart(frames)
        if not self._sock.poll(int(timeout_s * 1000)):
            raise AssertionError(f"no reply from the daemon to {frames!r}")
        header, body = self._sock.recv_multipart()
        return msgpack.unpackb(header), msgpack.unpackb(body)

    def request(self, type_: str, body: dict, msg_id: int = 1, version: int = PROTOCOL_VERSION) -> tuple[dict, dict]:
        header = {"version": version, "type": type_, "id": msg_id, "parent": None}
        return self.send([msgpack.packb(header), msgpack.packb(body, use_bin_type=True)])

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()


# -- a second local user --------------------------------------------------------------------


MALLORY = "dsmallory"


@pytest.fixture(scope="module")
def mallory() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("a second user needs root to create (useradd) and to act as (runuser)")
    if shutil.which("useradd") is None or shutil.which("runuser") is None:
        pytest.skip("useradd or runuser is not installed")
    made = False
    try:
        pwd.getpwnam(MALLORY)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", MALLORY], check=True)
        made = True
    yield MALLORY
    if made:
        subprocess.run(["userdel", MALLORY], check=False)


def as_user(user: str, script: str) -> None:
    subprocess.run(["runuser", "-u", user, "--", "sh", "-c", script], check=True, timeout=60)


@contextlib.contextmanager
def tmp_folder(prefix: str, mode: int) -> Iterator[Path]:
    """A folder under /tmp of ``mode``, removed after (pytest's own tmp folders are private to this user)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    os.chmod(folder, mode)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def open_tmp() -> Iterator[Path]:
    """A folder other users can reach."""
    with tmp_folder("ds-hostile-", 0o755) as folder:
        yield folder
