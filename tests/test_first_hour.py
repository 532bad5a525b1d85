"""A user's first hour: no daemon yet, datastatesctl from a shell, and what ``status`` says while a snapshot moves."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from datastates.client import Client, daemon_status
from datastates.protocol.errors import DaemonNotRunning, DaemonUnavailable

from conftest import DATASTATESCTL, DaemonFactory, DaemonProc, save

HANG_GUARD_S = 120
"""Only against a hang: every call here that meets no daemon must fail long before."""

NO_TORCH = """
import sys
from datastates.client.ctl import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
if "torch" in sys.modules:
    print("datastatesctl imported torch", file=sys.stderr)
    sys.exit(99)
sys.exit(code)
"""
"""datastatesctl's main, failing (99) if the command imported torch: what keeps it answering at once."""


def ctl_without_torch(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert run.returncode != 99, f"datastatesctl {' '.join(args)} imported torch"
    return run


def in_subprocess(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.fixture(scope="module")
def slow_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """A daemon whose snapshots move through a 4 MiB pool and one flush thread: long enough to be seen mid-flight."""
    factory = DaemonFactory(tmp_path_factory.mktemp("first-hour"))
    yield factory.start(host_memory="4MiB", chunk_size="1MiB", flush_threads=1, copy_threads=1, direct_io=False)
    factory.stop_all_later()


# -- no daemon ------------------------------------------------------------------------------------------


def test_client_without_a_daemon_says_so_at_once(short_tmp: Path) -> None:
    """With the default timeout and liveness, Client() names the endpoint and how to start a daemon, without waiting."""
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    run = in_subprocess(f"""
from datastates.client import Client
from datastates.protocol.errors import DaemonNotRunning
try:
    Client({endpoint!r}, timeout=3600, liveness=3600)
except DaemonNotRunning as exc:
    print(exc.message)
""")
    assert run.returncode == 0, run.stderr
    assert endpoint in run.stdout and "does not exist" in run.stdout
    assert "datastatesd --node-config" in run.stdout and "DATASTATES_ENDPOINT" in run.stdout


def test_a_socket_file_nobody_listens_on_is_no_daemon(short_tmp: Path) -> None:
    """A socket file a dead daemon left behind: nothing listens, so no daemon runs there."""
    path = short_tmp / "left.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))
    with pytest.raises(DaemonNotRunning, match="nothing listens on") as exc:
        daemon_status(f"ipc://{path}", timeout=3600)
    assert isinstance(exc.value, DaemonUnavailable), "handlers of DaemonUnavailable still catch it"


def test_a_stopped_daemon_is_still_a_liveness_matter(start_daemon: Any) -> None:
    """A daemon that answered, then stopped (SIGSTOP), is not "not running": wait() gets the liveness error,
    and a new status request gets no reply within its timeout."""
    d = start_daemon()
    c = Client(d.endpoint, timeout=60, liveness=1.0)
    c.snapshot({"w": torch.randn(1 << 16)}, d.root / "global_step1" / "model_states.pt")
    d.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable, match="no sign of life") as waited:
            c.wait()
        assert not isinstance(waited.value, DaemonNotRunning)
        with pytest.raises(DaemonUnavailable, match="does not answer") as asked:
            daemon_status(d.endpoint, timeout=1)
        assert not isinstance(asked.value, DaemonNotRunning)
    finally:
        d.proc.send_signal(signal.SIGCONT)
        c.timeout = 0.5
        c.close()


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["status", "--watch", "--count", "1"],
                                  ["wait"], ["shutdown"]])
def test_ctl_without_a_daemon_says_so_at_once(short_tmp: Path, args: list[str]) -> None:
    """Every command that asks the daemon exits 2 with the same clear error at once, not after a connect timeout
    (the subprocess's own timeout, far below the 3600 s a retry loop would take, says so)."""
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    run = ctl_without_torch("--endpoint", endpoint, *args)
    assert run.returncode == 2
    assert f"no datastatesd is running at {endpoint}" in run.stderr and "datastatesd --node-config" in run.stderr


def test_a_job_script_waits_for_the_daemon_it_just_started(start_daemon: Any, short_tmp: Path) -> None:
    """``datastatesctl --connect-timeout S status``, as deploy/torchrun.sh runs it right after launching the daemon:
    a daemon whose socket does not exist yet is waited for, and the probe returns once it answers."""
    endpoint = f"ipc://{short_tmp}/later/datastatesd.sock"
    probe = subprocess.Popen([DATASTATESCTL, "--endpoint", endpoint, "--connect-timeout", "120", "status", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        d = start_daemon(endpoint=endpoint)
        out, err = probe.communicate(timeout=120)
    finally:
        probe.kill()
    assert probe.returncode == 0, err
    assert json.loads(out)["daemon"]["pid"] == d.proc.pid


# -- datastatesctl without torch ------------------------------------------------------------------------


def test_ctl_answers_without_importing_torch(slow_daemon: DaemonProc) -> None:
    """--help, status, wait, ls and verify never import torch (only convert needs tensors)."""
    with Client(slow_daemon.endpoint, timeout=60) as c:
        committed = save(c, {"w": torch.randn(1000), "step": 1}, slow_daemon.root / "notorch" / "model_states.pt")
    ep = ["--endpoint", slow_daemon.endpoint]

    assert "status" in ctl_without_torch("--help").stdout
    status = ctl_without_torch(*ep, "status", "--json")
    assert status.returncode == 0 and "notorch" in {t["tag"] for t in json.loads(status.stdout)["committed"]}
    assert "notorch" in ctl_without_torch(*ep, "status").stdout
    assert ctl_without_torch(*ep, "wait", "--timeout", "60").returncode == 0
    listed = ctl_without_torch(*ep, "ls", str(slow_daemon.root))
    assert listed.returncode == 0 and "notorch" in listed.stdout
    verified = ctl_without_torch("verify", str(Path(committed.files[0]).parent))
    assert verified.returncode == 0 and verified.stdout.startswith("ok"), verified.stdout + verified.stderr
    watched = ctl_without_torch(*ep, "status", "--watch", "--count", "2", "--interval", "0.1")
    assert watched.returncode == 0, watched.stderr
    assert "host memory" in watched.stdout and "snapshots" in watched.stdout


def test_ls_and_status_count_a_tags_files_alike(slow_daemon: DaemonProc) -> None:
    """A tag of two files, beside a stray file in its folder: ls and status both say 2, the files its marker lists."""
    tag = slow_daemon.root / "two-files"
    with Client(slow_daemon.endpoint, timeout=60) as c:
        for name in ("a.pt", "b.pt"):
            c.snapshot({"w": torch.randn(100)}, tag / name)
        c.wait()
        c.commit("two-files").result(timeout=120)
    (tag / "notes.txt").write_text("not part of the tag")

    status = json.loads(slow_daemon.ctl("status", "--json").stdout)
    (entry,) = [e for e in status["committed"] if e["tag"] == "two-files"]
    (line,) = [ln for ln in slow_daemon.ctl("ls", str(slow_daemon.root)).stdout.splitlines()
               if ln.startswith("two-files ")]
    assert entry["files"] == 2 and line.split()[4] == "2", line


# -- status while a snapshot moves ----------------------------------------------------------------------


def sample_until_durable(endpoint: str, snapshot_id: int) -> list[dict[str, Any]]:
    """(the snapshot's status, the pool's) as often as status answers, until snapshot ``snapshot_id`` is done."""
    samples = []
    while True:
        st = daemon_status(endpoint, timeout=60)
        job = next(j for j in st["snapshots"] if j["id"] == snapshot_id)
        samples.append({"job": job, "pool": st["daemon"]["host_memory"]})
        if job["state"] in ("durable", "failed"):
            return samples


def test_status_progress_and_rates_are_consistent(slow_daemon: DaemonProc) -> None:
    """Through three saves of one file (each kept as the daemon's in-memory replica, the later ones written over
    the earlier's), every status sample is consistent: copied <= total, flushed <= copied, progress never goes back, a rate is above 0
    whenever its bytes moved since the previous sample, and every pool chunk is copying, flushing or free."""
    path = slow_daemon.root / "moving" / "model_states.pt"
    with Client(slow_daemon.endpoint, timeout=60) as c:
        for step in range(3):
            state = {f"w{i}": torch.randn(1 << 21) for i in range(4)}  # 32 MiB through a 4 MiB pool
            handle = c.snapshot(state, path, tag="moving")
            samples = sample_until_durable(slow_daemon.endpoint, handle.id)
            c.wait()
            c.commit("moving").result(timeout=120)

            total = samples[0]["job"]["total_bytes"]
            for s in samples:
                job, pool = s["job"], s["pool"]
                assert 0 <= job["flushed_bytes"] <= job["copied_bytes"] <= job["total_bytes"] == total, job
                assert pool["chunks_copying"] >= 0 and pool["chunks_flushing"] >= 0 and pool["chunks_free"] >= 0
                assert pool["chunks_copying"] + pool["chunks_flushing"] + pool["chunks_free"] == \
                    pool["budget_bytes"] // pool["chunk_size"], pool
            for before, after in zip(samples, samples[1:]):
                b, a = before["job"], after["job"]
                assert a["copied_bytes"] >= b["copied_bytes"] and a["flushed_bytes"] >= b["flushed_bytes"]
                if a["copied_bytes"] > b["copied_bytes"]:
                    assert a["copy_bps"] > 0, (b, a)
                if a["flushed_bytes"] > b["flushed_bytes"]:
                    assert a["flush_bps"] > 0 and a["throughput_bps"] > 0, (b, a)
            done = samples[-1]["job"]
            assert done["state"] == "durable", done
            assert done["copied_bytes"] == done["flushed_bytes"] == total == 4 * (8 << 20)
            assert done["copy_bps"] > 0 and done["flush_bps"] > 0 and done["throughput_bps"] > 0
    pool = daemon_status(slow_daemon.endpoint)["daemon"]["host_memory"]
    assert pool["chunks_copying"] == pool["chunks_flushing"] == 0, "every chunk is back once nothing moves"
