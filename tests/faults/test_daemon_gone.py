"""A daemon that dies under a trainer, or none at all: DaemonUnavailable, never a hang, or the opt-in local fallback."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import DaemonNotRunning, DaemonUnavailable

from conftest import DaemonProc, assert_state_equal, save

LIVENESS = 2.0


def kill9(d: DaemonProc) -> None:
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(30)


def test_wait_raises_when_the_daemon_dies(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    with Client(d.endpoint, timeout=30, liveness=LIVENESS) as c:
        c.snapshot({"w": torch.randn(1 << 20)}, d.root / "global_step1" / "model_states.pt")
        kill9(d)
        with pytest.raises(DaemonUnavailable, match="no sign of life"):
            c.wait()


def test_pending_commit_fails_when_the_daemon_dies(start_daemon: Callable[..., DaemonProc]) -> None:
    """A commit future outstanding when the daemon is killed resolves with an error, not never."""
    d = start_daemon(host_memory="2MiB", chunk_size="1MiB")
    with Client(d.endpoint, timeout=30, liveness=LIVENESS) as c:
        c.snapshot({f"w{i}": torch.randn(1 << 20) for i in range(16)}, d.root / "global_step1" / "model_states.pt")
        fut = c.commit("global_step1")
        kill9(d)
        with pytest.raises(DaemonUnavailable):
            fut.result(timeout=120)  # a hang guard only: liveness fails it after ~2 s


def test_a_busy_daemon_is_not_taken_for_dead(start_daemon: Callable[..., DaemonProc]) -> None:
    """A flush longer than the liveness window still commits: the daemon answers probes meanwhile."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB", flush_threads=1, direct_io=False)
    state = {f"w{i}": torch.randn(1 << 21) for i in range(48)}  # 384 MiB through a 4 MiB pool
    with Client(d.endpoint, timeout=60, liveness=0.2) as c:
        c.snapshot(state, d.root / "global_step2" / "model_states.pt")
        committed = c.commit("global_step2").result(timeout=300)
    assert committed.tag == "global_step2"


def test_local_fallback_without_a_daemon(short_tmp: Path) -> None:
    """fallback='local' with no daemon at all: the trainer writes the same files, blocking, and latest() finds them."""
    root = short_tmp / "ckpt"
    state = {"w": torch.randn(3 << 20), "step": 5}  # more than one 16 MiB piece
    with Client(f"ipc://{short_tmp}/none.sock", timeout=1, fallback="local") as c:
        assert c.local
        handle = c.snapshot(state, root / "global_step5" / "model_states.pt")
        c.wait()
        assert handle.nbytes == state["w"].nbytes
        committed = c.commit("global_step5").result(timeout=0)
    assert committed.files == [str(root / "global_step5" / "model_states.pt")]
    assert datastates.latest(root) == "global_step5"
    assert_state_equal(state, datastates.load(root / "global_step5" / "model_states.pt"))


def test_local_fallback_takes_over_when_the_daemon_dies(start_daemon: Callable[..., DaemonProc]) -> None:
    """The snapshot the dead daemon never confirmed is saved again by the trainer: its tensors are still unchanged."""
    d = start_daemon()
    state = {"w": torch.randn(1 << 20)}
    with Client(d.endpoint, timeout=30, liveness=LIVENESS, fallback="local") as c:
        save(c, state, d.root / "global_step1" / "model_states.pt")
        kill9(d)
        state["w"].add_(1)
        c.snapshot(state, d.root / "global_step2" / "model_states.pt")
        c.wait()  # finds the daemon gone after `liveness`, then saves locally
        assert c.local
        c.commit("global_step2").result(timeout=0)
    assert datastates.latest(d.root) == "global_step2"
    assert_state_equal(state, datastates.load(d.root / "global_step2" / "model_states.pt"))


def test_without_fallback_a_dead_daemon_is_an_error_at_the_next_snapshot(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    with Client(d.endpoint, timeout=30, liveness=LIVENESS) as c:
        c.snapshot({"w": torch.randn(8)}, d.root / "global_step1" / "model_states.pt")
        kill9(d)
        with pytest.raises(DaemonUnavailable):
            c.wait()
        with pytest.raises(DaemonNotRunning, match="no datastatesd is running"):  # it tries to connect again
            c.snapshot({"w": torch.randn(8)}, d.root / "global_step2" / "model_states.pt")
