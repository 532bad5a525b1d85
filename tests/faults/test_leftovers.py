"""I5, leftovers: the next daemon removes what any killed daemon of this user and node left, whatever endpoint either used.

Deploy scripts give each job its own endpoint, so a daemon killed with a snapshot in flight
leaves temporary files under the roots and its replica folder in /dev/shm (up to the
memory_restore budget) that no daemon of its endpoint will ever come back for. The next
daemon on the node, on any endpoint, removes them before admitting a snapshot and reports
them in ``status``; a live daemon's files are left alone.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.format import TEMP_SUFFIX

from conftest import DaemonProc, assert_state_equal, save

SLOW = {"host_memory": "2MiB", "chunk_size": "1MiB", "flush_threads": 1, "direct_io": False}


def replica_folders() -> set[str]:
    """Daemons' replica folders (an owner tag of 16 hex digits), not clients' decision folders."""
    return {p for p in glob.glob(f"/dev/shm/datastates-{os.geteuid()}-*") if re.fullmatch(r"[0-9a-f]{16}", p[-16:])
            and p[-17] == "-"}


def replica_folder(d: DaemonProc) -> str:
    """The replica folder of daemon ``d``, named by the owner tag its log announces at start: other daemons of
    this user (a test session or a job beside this one) have folders of their own, which these tests leave be."""
    owner = re.search(r"owner ([0-9a-f]{16})", d.log_text())
    assert owner is not None, d.log_text()[-2000:]
    return f"/dev/shm/datastates-{os.geteuid()}-{owner.group(1)}"


def temps(root: Path) -> list[Path]:
    return list(root.rglob(f"*{TEMP_SUFFIX}"))


def removed_at_start(d: DaemonProc) -> dict:
    for _ in range(600):
        report = json.loads(d.ctl("status", "--json").stdout)["daemon"]["leftovers_removed"]
        if report is not None:
            return report
        time.sleep(0.1)
    raise AssertionError("the daemon never finished its start-up recovery")


@pytest.mark.heavy
def test_a_daemon_on_another_endpoint_removes_a_killed_daemons_leftovers_and_spares_a_live_one(
        start_daemon: Callable[..., DaemonProc]) -> None:
    live = start_daemon()  # another job's daemon on this node: its replica folder must survive
    with Client(live.endpoint, timeout=60) as c:
        save(c, {"w": torch.ones(1000)}, live.root / "live" / "step1" / "m.pt")
    mine = replica_folder(live)
    assert mine in replica_folders()

    doomed = start_daemon(**SLOW)
    assert replica_folder(doomed) in replica_folders()
    c = Client(doomed.endpoint, timeout=60)
    try:
        save(c, {"w": torch.zeros(1000)}, doomed.root / "run" / "step1" / "m.pt")  # its replica now holds a file
        c.snapshot({"w": torch.randn(32 << 20)}, doomed.root / "run" / "step2" / "m.pt")  # 128 MiB through 2 MiB
        for _ in range(600):
            job = next((j for j in c.status()["snapshots"] if j["tag"] == "step2"), None)  # admitted yet?
            if job is not None and job["flushed_bytes"] > 0:
                break
            time.sleep(0.01)
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(30)
    finally:
        c.close(timeout=0.5)  # its daemon is gone: no need to wait for its liveness to say so
    left = {str(p) for p in temps(doomed.root)} | (replica_folders() & {replica_folder(doomed)})
    # its replica folder too, unless a daemon of another session beside this one started meanwhile and removed it
    # first, as every daemon of the node does at start (this test's point, seen from the other side)
    assert any(p.endswith(TEMP_SUFFIX) for p in left), left

    fresh = start_daemon()  # a new job, a new endpoint
    report = removed_at_start(fresh)
    assert set(report["paths"]) >= left and report["count"] >= len(left), (report, left)
    assert not temps(doomed.root) and not (replica_folders() & left)
    assert mine in replica_folders()  # the live daemon's replica folder is untouched...
    restored = Client(live.endpoint, timeout=60)
    try:  # ...and still serves a restore from memory
        got = restored.restore(live.root / "live", "m.pt")
        assert got is not None and got.source == "memory", got
        assert_state_equal({"w": torch.ones(1000)}, got.state)
    finally:
        restored.close()
    assert datastates.latest(doomed.root / "run") == "step1"
