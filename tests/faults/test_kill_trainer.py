"""kill -9 of the training process: the daemon keeps what it can prove whole and lets go of the rest.

With ``cpu_capture="shm"``, once the daemon has admitted a snapshot (its SNAPSHOT_ACK,
``handle.id``) it holds its own mappings of the trainer's shared memory, so the trainer's
death changes nothing: the copy completes, the file is written, and the tag is committed if
the trainer had asked. Read in place (the default), the trainer's memory goes with it, so a
snapshot not yet copied fails whole: no file, no marker. Either way the daemon then notices
the trainer is gone, drops the client and its memory, and keeps serving everyone else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status

from conftest import DaemonProc, assert_state_equal, save, temp_files

CLIENT_TIMEOUT = 1.5

TRAINER = r"""
import sys, time, torch
from datastates.client import Client
endpoint, path, tag, n, commit, capture = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6]
g = torch.Generator().manual_seed(n)
state = {"w": [torch.randn(1 << 20, generator=g) for _ in range(n)], "step": n}
c = Client(endpoint, timeout=60, cpu_capture=capture)
assert c.in_place == (capture == "auto"), "the daemon reads this trainer in place"
handle = c.snapshot(state, path, tag=tag)
if commit:
    c.commit(tag)
handle.id  # admitted: the daemon has mapped the trainer's memory
print("SENT", flush=True)
time.sleep(600)
"""


def expected_state(n: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {"w": [torch.randn(1 << 20, generator=g) for _ in range(n)], "step": n}


OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--kill-child"]
"""A trainer in a container of its own: the daemon cannot see its pid, and must go by heartbeats."""


def start_trainer(d: DaemonProc, path: Path, tag: str, n: int, commit: bool, prefix: list[str] = [],
                  capture: str = "shm") -> subprocess.Popen:
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", TRAINER, d.endpoint, str(path), tag, str(n), "1" if commit else "0", capture],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "SENT", f"the trainer did not get its snapshot admitted (exit {proc.poll()})"
    return proc


def status(d: DaemonProc) -> dict[str, Any]:
    return daemon_status(d.endpoint, timeout=30)


def wait_lost(d: DaemonProc, how: str) -> dict[str, Any]:
    """The daemon's status once it has taken the trainer as gone (a hang guard, not a timing check)."""
    for _ in range(600):
        st = status(d)
        if st["clients_lost"]:
            assert st["clients_lost"][0]["how"].startswith(how), st["clients_lost"]
            return st
        time.sleep(0.1)
    raise AssertionError("the daemon never noticed that the trainer is gone")


def daemon_shm_maps(d: DaemonProc) -> list[str]:
    """The trainers' shared-memory segments (torch names them torch_<pid>_...) the daemon maps or holds open."""
    with open(f"/proc/{d.proc.pid}/maps") as f:
        held = [line.strip() for line in f if "/dev/shm/torch_" in line]
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/torch_"):
            held.append(target)
    return held


def pid_namespace_works() -> bool:
    return subprocess.run([*OWN_PID_NAMESPACE, "true"], capture_output=True).returncode == 0


@pytest.mark.parametrize("namespace", ["same pid namespace", "own pid namespace"])
def test_trainer_killed_right_after_snapshot_is_still_committed(
    start_daemon: Callable[..., DaemonProc], namespace: str
) -> None:
    prefix = OWN_PID_NAMESPACE if namespace == "own pid namespace" else []
    if prefix and not pid_namespace_works():
        pytest.skip("unshare --pid is not permitted here, so the heartbeat-watched case cannot be staged")
    d = start_daemon(client_timeout=CLIENT_TIMEOUT)
    path = d.root / "global_step7" / "model_states.pt"
    trainer = start_trainer(d, path, "global_step7", n=24, commit=True, prefix=prefix)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(30)

    assert d.ctl("wait", "--timeout", "120").returncode == 0
    assert datastates.latest(d.root) == "global_step7"
    assert_state_equal(expected_state(24), datastates.load(path))
    st = wait_lost(d, "silent" if prefix else "exited")
    assert st["clients"] == []
    assert daemon_shm_maps(d) == []


def test_trainer_killed_mid_copy_is_finished_and_released(start_daemon: Callable[..., DaemonProc]) -> None:
    """Shared memory: mid-copy the daemon still copies from its own mapping; the file is whole, and uncommitted."""
    d = start_daemon(client_timeout=CLIENT_TIMEOUT, host_memory="4MiB", chunk_size="1MiB", flush_threads=1)
    with Client(d.endpoint, timeout=60) as bystander:
        save(bystander, {"x": torch.arange(10)}, d.root / "global_step1" / "model_states.pt")
        path = d.root / "global_step2" / "model_states.pt"
        trainer = start_trainer(d, path, "global_step2", n=128, commit=False)  # 512 MiB through a 4 MiB pool
        job = next(j for j in status(d)["snapshots"] if j["path"] == str(path))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        assert job["state"] == "copying" and job["copied_bytes"] < job["total_bytes"], job  # the kill came mid-copy

        assert d.ctl("wait", "--timeout", "300").returncode == 0
        job = next(j for j in status(d)["snapshots"] if j["path"] == str(path))
        assert job["state"] == "durable", job
        assert_state_equal(expected_state(128), datastates.load(path))
        assert datastates.latest(d.root) == "global_step1"  # never committed: no marker

        st = wait_lost(d, "exited")
        assert st["daemon"]["host_memory"]["chunks_in_use"] == 0
        assert not [m for m in daemon_shm_maps(d) if f"/torch_{trainer.pid}_" in m]
        for _ in range(300):  # torch's shm manager unlinks a dead process's segments on its own time
            left = [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{trainer.pid}_")]
            if not left:
                break
            time.sleep(0.1)
        assert not left, f"{len(left)} segments of the killed trainer are still in /dev/shm: {left[:4]}"

        save(bystander, {"x": torch.arange(20)}, d.root / "global_step3" / "model_states.pt")
        assert datastates.latest(d.root) == "global_step3"
        assert_state_equal({"x": torch.arange(20)}, datastates.load(d.root / "global_step3" / "model_states.pt"))


def test_an_idle_trainer_is_not_taken_for_gone(start_daemon: Callable[..., DaemonProc]) -> None:
    """Heartbeats keep a client that sends nothing for several timeouts registered."""
    d = start_daemon(client_timeout=CLIENT_TIMEOUT)
    with Client(d.endpoint, timeout=60) as c:
        time.sleep(4 * CLIENT_TIMEOUT)
        save(c, {"x": torch.ones(3)}, d.root / "global_step1" / "model_states.pt")
        assert status(d)["clients_lost"] == []
    assert datastates.latest(d.root) == "global_step1"


def test_a_trainer_killed_before_its_in_place_copy_ends_leaves_nothing(start_daemon: Callable[..., DaemonProc]) -> None:
    """Read in place: the kill fails the snapshot whole (no file, no marker) and nothing else."""
    d = start_daemon(client_timeout=CLIENT_TIMEOUT, host_memory="4MiB", chunk_size="1MiB", flush_threads=1)
    with Client(d.endpoint, timeout=60) as bystander:
        assert bystander.in_place
        save(bystander, {"x": torch.arange(10)}, d.root / "global_step1" / "model_states.pt")
        path = d.root / "global_step2" / "model_states.pt"
        trainer = start_trainer(d, path, "global_step2", n=128, commit=True, capture="auto")
        job = next(j for j in status(d)["snapshots"] if j["path"] == str(path))
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
        assert job["state"] == "copying" and job["copied_bytes"] < job["total_bytes"], job  # the kill came mid-copy

        d.ctl("wait", "--timeout", "300")
        job = next(j for j in status(d)["snapshots"] if j["path"] == str(path))
        assert job["state"] == "failed" and "trainer" in job["error"], job
        assert not path.exists() and temp_files(d.root) == []
        assert datastates.latest(d.root) == "global_step1", "a tag whose file failed was committed"

        st = wait_lost(d, "exited")
        assert st["daemon"]["host_memory"]["chunks_in_use"] == 0
        save(bystander, {"x": torch.arange(20)}, d.root / "global_step3" / "model_states.pt")
        assert datastates.latest(d.root) == "global_step3"
        assert_state_equal({"x": torch.arange(20)}, datastates.load(d.root / "global_step3" / "model_states.pt"))
