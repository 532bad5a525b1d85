"""A daemon that dies under a trainer: every call raises DaemonUnavailable, none hangs."""

from __future__ import annotations

import signal
from typing import Callable

import pytest
import torch

from datastates.client import Client
from datastates.protocol.errors import DaemonUnavailable

from conftest import DaemonProc

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
