"""datastatesctl and the daemon's lifecycle, as an operator or a job script uses them."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import UnknownClientError

from conftest import DATASTATESCTL, DATASTATESD, DaemonProc, assert_state_equal, run_datastatesd, save, temp_files, wait_ready


def big_state(mib: int, seed: int = 0) -> dict[str, Any]:
    """About ``mib`` MiB of float32 in four tensors, so a drain has real work left when shutdown arrives."""
    g = torch.Generator().manual_seed(seed)
    quarter = (mib << 20) // 16
    return {f"layer{i}.weight": torch.randn(quarter, generator=g) for i in range(4)} | {"step": 1000}


def close_orphaned(client: Client) -> None:
    """Close a client whose daemon has exited, without waiting the full BYE timeout for an answer that cannot come."""
    client.timeout = 0.5
    client.close(timeout=0.5)


def test_status_shows_clients_snapshots_and_commits(client: Client, daemon: DaemonProc) -> None:
    """status and status --json show who is connected, each snapshot's progress, and what is committed."""
    state = {"w": torch.randn(1 << 18), "b": torch.randn(10)}
    handle = client.snapshot(state, daemon.root / "global_step3" / "model_states.pt")
    client.wait()
    client.commit("global_step3").result(timeout=120)

    run = daemon.ctl("status", "--json")
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert [c["id"] for c in status["clients"]] == [client.client_id]
    (snap,) = status["snapshots"]
    assert snap["id"] == handle.id and snap["state"] == "durable" and snap["path"] == handle.path
    assert snap["total_bytes"] == snap["copied_bytes"] == snap["flushed_bytes"] == handle.nbytes > 0
    assert status["pending"] == 0 and status["commits_pending"] == 0
    (commit,) = status["committed"]
    assert commit["tag"] == "global_step3" and commit["files"] == 1 and Path(commit["marker"]).is_file()
    assert status["daemon"]["pid"] == daemon.proc.pid and status["daemon"]["roots"] == [str(daemon.root)]

    text = daemon.ctl("status")
    assert text.returncode == 0, text.stderr
    assert client.client_id in text.stdout and f"pid {daemon.proc.pid}" in text.stdout
    (line,) = [ln for ln in text.stdout.splitlines() if handle.path in ln]
    assert "durable" in line and line.count("100%") == 2 and "global_step3" in line
    committed_section = text.stdout.split("committed tags:")[1]
    assert "global_step3" in committed_section and commit["marker"] in committed_section


def test_wait_returns_once_everything_is_durable(client: Client, daemon: DaemonProc) -> None:
    """A job script can `datastatesctl wait` after the trainer's snapshots and then rely on the files."""
    states = {daemon.root / "global_step4" / f"shard{i}.pt": big_state(4, seed=i) for i in range(3)}
    for path, state in states.items():
        client.snapshot(state, path)

    run = daemon.ctl("wait", "--timeout", "60")
    assert run.returncode == 0, run.stderr

    status = json.loads(daemon.ctl("status", "--json").stdout)
    assert status["pending"] == 0
    assert {s["state"] for s in status["snapshots"]} == {"durable"}
    for path, state in states.items():
        assert_state_equal(state, datastates.load(path))


def test_shutdown_drains_first(client: Client, daemon: DaemonProc) -> None:
    """`datastatesctl shutdown` returns only after what was snapshotted just before it is on disk, then the daemon exits 0."""
    state = big_state(32)
    path = daemon.root / "global_step5" / "model_states.pt"
    client.snapshot(state, path)

    run = daemon.ctl("shutdown", timeout=120)
    assert run.returncode == 0, run.stderr
    assert daemon.proc.wait(60) == 0
    close_orphaned(client)

    assert_state_equal(state, datastates.load(path))
    assert temp_files(daemon.root) == []
    assert "draining" in daemon.log_text()


def test_sigterm_drains_first(start_daemon: Callable[..., DaemonProc]) -> None:
    """SIGTERM (what a scheduler sends at the end of a job) finishes every snapshot already taken, then exits 0."""
    daemon = start_daemon()
    client = Client(daemon.endpoint, timeout=60)
    state = big_state(100, seed=1)
    path = daemon.root / "global_step6" / "model_states.pt"
    handle = client.snapshot(state, path)
    daemon.proc.send_signal(signal.SIGTERM)

    assert daemon.proc.wait(120) == 0
    close_orphaned(client)
    assert handle.nbytes >= 100 << 20
    assert_state_equal(state, datastates.load(path))
    assert temp_files(daemon.root) == []


def test_sigusr2_logs_every_threads_and_tasks_stack_and_the_daemon_serves_on(client: Client, daemon: DaemonProc) -> None:
    """``kill -USR2`` on a daemon that seems stuck: where each thread and task is, in its log; nothing stops."""
    stacks = daemon.stacks()
    assert "thread MainThread:" in stacks and "ds-" in stacks, stacks[:2000]  # the loop's thread and the daemon's own
    assert "Stack for <Task" in stacks, stacks[:2000]  # the event loop's tasks (the serve loop among them)
    state = {"w": torch.arange(1000.0)}
    save(client, state, daemon.root / "after-usr2" / "rank0.pt")
    assert_state_equal(state, datastates.load(daemon.root / "after-usr2" / "rank0.pt"))
    assert daemon.proc.poll() is None


def test_second_daemon_on_the_same_endpoint_refuses(daemon: DaemonProc) -> None:
    """Starting a second daemon with the same config fails clearly and leaves the first one serving."""
    run = run_datastatesd("--node-config", str(daemon.config), timeout=30)
    assert run.returncode != 0
    assert "already serving" in run.stderr and daemon.endpoint in run.stderr
    assert daemon.proc.poll() is None
    status = daemon.ctl("status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["daemon"]["pid"] == daemon.proc.pid


@pytest.mark.parametrize("args", [["--interval", "-1"], ["--interval", "nan"], ["--interval", "0"], ["--interval", "inf"],
                                  ["--interval", "1e300"], ["--interval", "soon"], ["--count", "0"], ["--count", "-3"]],
                         ids=" ".join)
def test_status_watch_refuses_bad_arguments_without_a_traceback(shared_daemon: DaemonProc, args: list[str]) -> None:
    """``status --watch --interval -1`` (or nan) printed a traceback from ``time.sleep`` once the
    daemon had answered; each bad value is now a usage error naming the option, exit 2, before anything is asked."""
    out = subprocess.run([DATASTATESCTL, "--endpoint", shared_daemon.endpoint, "status", "--watch", "--count", "2",
                          *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"argument {args[0]}" in out.stderr, out.stderr


CTL_COMMANDS = {"status": ["status"], "status-json": ["status", "--json"], "wait": ["wait", "--timeout", "5"],
                "shutdown": ["shutdown"]}


@pytest.fixture(scope="module")
def ctl_without_a_daemon_runs() -> Iterator[dict[str, tuple[str, Any]]]:
    """Every ctl command against an endpoint nobody serves, two at a time (each mostly waits): (endpoint, run) by id."""
    folder = Path(tempfile.mkdtemp(prefix="ds-"))
    endpoints = {case: f"ipc://{folder}/{case}/nobody.sock" for case in CTL_COMMANDS}
    for case in CTL_COMMANDS:
        (folder / case).mkdir()

    def run(case: str) -> Any:
        try:
            return subprocess.run([DATASTATESCTL, "--endpoint", endpoints[case], "--connect-timeout", "1", *CTL_COMMANDS[case]],
                                  capture_output=True, text=True, timeout=15)
        except subprocess.TimeoutExpired as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(CTL_COMMANDS, pool.map(run, CTL_COMMANDS)))
    yield {case: (endpoints[case], runs[case]) for case in CTL_COMMANDS}
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("case", list(CTL_COMMANDS))
def test_ctl_without_a_daemon(ctl_without_a_daemon_runs: dict[str, tuple[str, Any]], case: str) -> None:
    """Every ctl command against an endpoint nobody serves exits non-zero within its connect timeout and says why."""
    endpoint, run = ctl_without_a_daemon_runs[case]
    if isinstance(run, subprocess.TimeoutExpired):
        pytest.fail(f"datastatesctl {' '.join(CTL_COMMANDS[case])} hung against {endpoint}, where no daemon runs, "
                    "despite --connect-timeout 1")
    assert run.returncode != 0
    assert f"no datastatesd is running at {endpoint}" in run.stderr, run.stderr
    assert "datastatesd --node-config" in run.stderr


def test_daemon_restart_tells_old_clients_to_reconnect(start_daemon: Callable[..., DaemonProc]) -> None:
    """After a daemon restart on the same endpoint, an old client is told it is unknown; a new one is served."""
    daemon = start_daemon()
    old = Client(daemon.endpoint, timeout=60)
    assert daemon.stop() == 0

    log = daemon.log.with_name("restarted.log")
    proc = subprocess.Popen([DATASTATESD, "--node-config", str(daemon.config)], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready(daemon.endpoint, proc, log)
        state = {"w": torch.randn(1000)}
        old.snapshot(state, daemon.root / "global_step1" / "model_states.pt")  # sent; the refusal comes back
        with pytest.raises(UnknownClientError, match="reconnect"):
            old.wait()
        old.close()
        with Client(daemon.endpoint, timeout=60) as new:
            save(new, state, daemon.root / "global_step1" / "model_states.pt")
        assert_state_equal(state, datastates.load(daemon.root / "global_step1" / "model_states.pt"))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
