"""Telling whether a trainer still lives (protocol/liveness.py), on real processes.

A GPU snapshot whose trainer is gone when its copy ends must fail, so the daemon must
see a death at once: an exited process that its parent has not reaped yet (a zombie)
is gone, and where pid namespaces cannot be compared (gVisor) the start time decides.
"""

from __future__ import annotations

import os
import subprocess
import time

from datastates.protocol.liveness import process_start, shares_pids


def test_a_zombie_trainer_is_gone_before_its_parent_reaps_it() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_start(child.pid) is not None
        child.kill()
        for _ in range(600):  # until the kernel has made it a zombie: exited, not reaped (WNOWAIT)
            if os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the killed child never became a zombie")
        assert process_start(child.pid) is None, "a zombie, not reaped yet, still counts as a live trainer"
    finally:
        child.kill()
        child.wait()


def test_without_namespaces_the_start_time_decides_whether_a_pid_is_watched() -> None:
    me = process_start(os.getpid())
    assert me is not None
    assert shares_pids(0, me, os.getpid())  # no namespace to compare: the same start time is the same process
    assert not shares_pids(0, str(int(me) + 1), os.getpid())  # a reused pid, or one of another namespace
    assert not shares_pids(0, "", os.getpid())  # an old client that sent no start time: heartbeats
