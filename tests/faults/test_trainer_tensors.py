"""What a snapshot may do to the trainer: nothing it can notice, and no memory kept past need.

Each trainer is a real process talking to a real daemon:

- a snapshot changes no tensor, read in place (the default) or copied through /dev/shm:
  resizing one afterwards, a numpy view taken before, a tensor made ``from_numpy`` all
  behave as if there had been no snapshot (when snapshots moved storages into /dev/shm,
  the first two crashed the trainer and the third diverged);
- a loop of ``snapshot()`` and ``commit().result()`` that never calls ``wait()`` holds no
  more than the snapshots in flight, and leaves nothing in /dev/shm;
- a trainer that names every file anew with fresh tensors (``epoch_{i}.pt``) keeps the
  daemon's memory flat, in place and through /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from conftest import DaemonProc

MiB = 1 << 20

TENSORS_AFTER = r"""
import json, sys
import numpy as np, torch
from datastates.client import Client
endpoint, root, capture = sys.argv[1], sys.argv[2], sys.argv[3]
t = torch.arange(1000, dtype=torch.float32)
view = t.numpy()                       # a numpy view taken before the snapshot
u = torch.ones(1000)
arr = np.zeros(100, dtype=np.float32)
shared = torch.from_numpy(arr)         # a tensor over numpy's memory
with Client(endpoint, timeout=60, cpu_capture=capture) as c:
    c.snapshot({"t": t, "shared": shared, "u": u}, f"{root}/step1/m.pt")
    c.wait()
    c.commit("step1").result(timeout=60)
    out = {"in_place": c.in_place}
view[0] = 42.0                         # writes through the old view must land in t
arr[:] = 7.0                           # and numpy's writes in the tensor made from it
out["view_follows"] = float(t[0]) == 42.0
out["from_numpy_follows"] = bool((shared == 7.0).all())
u.resize_(100000)                      # a resize after the snapshot must just work
u[-1] = 1.0
out["resized"] = u.numel()
print(json.dumps(out))
"""


def run_trainer(script: str, *args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the trainer died ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capture", ["auto", "shm"])
def test_a_snapshot_changes_nothing_in_the_trainer(shared_daemon: DaemonProc, capture: str) -> None:
    import torch

    import datastates

    out = run_trainer(TENSORS_AFTER, shared_daemon.endpoint, str(shared_daemon.root / f"untouched-{capture}"), capture)
    assert out["in_place"] == (capture == "auto")
    assert out["view_follows"], "a numpy view taken before the snapshot no longer shows the tensor's memory"
    assert out["from_numpy_follows"], "a tensor made from_numpy stopped following its array"
    assert out["resized"] == 100000
    saved = datastates.load(shared_daemon.root / f"untouched-{capture}" / "step1" / "m.pt")
    assert torch.equal(saved["t"], torch.arange(1000, dtype=torch.float32))
    assert torch.equal(saved["shared"], torch.zeros(100))
    assert torch.equal(saved["u"], torch.ones(1000))


COMMIT_LOOP = r"""
import json, os, sys
import torch
from datastates.client import Client
endpoint, root, capture, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

def segments():
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"torch_{os.getpid()}_")]

out = {"rss": []}
with Client(endpoint, timeout=60, cpu_capture=capture) as c:
    for i in range(steps):
        state = {"w": torch.full((2 << 20,), float(i)), "step": i}   # fresh 8 MiB each step
        c.snapshot(state, f"{root}/epoch_{i}/m.pt")
        c.commit(f"epoch_{i}").result(timeout=120)                     # never wait()
        del state
        out["rss"].append(rss())
    out["segments_open"] = len(segments())
out["segments_after_close"] = len(segments())
print(json.dumps(out))
"""


def daemon_memory(d: DaemonProc) -> tuple[int, int]:
    """The daemon's resident bytes, and the bytes of trainers' /dev/shm segments it maps."""
    with open(f"/proc/{d.proc.pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    mapped = 0
    with open(f"/proc/{d.proc.pid}/maps") as f:
        for line in f:
            if "/dev/shm/torch_" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                mapped += hi - lo
    return rss, mapped


@pytest.mark.parametrize("capture", ["auto", "shm"])
def test_commit_without_wait_and_new_names_keep_both_sides_flat(shared_daemon: DaemonProc, capture: str) -> None:
    """60 steps of fresh 8 MiB tensors, each to a new file name, committed without wait()."""
    import torch

    import datastates

    root = shared_daemon.root / f"flat-{capture}"
    steps = 60
    rss_before, _ = daemon_memory(shared_daemon)
    out = run_trainer(COMMIT_LOOP, shared_daemon.endpoint, str(root), capture, str(steps))
    rss_after, mapped = daemon_memory(shared_daemon)

    grew = out["rss"][-1] - out["rss"][19]  # the allocator keeps some freed blocks: a plateau, not a slope
    assert grew < 20 * 8 * MiB, f"the trainer grew {grew / MiB:.0f} MiB over 40 committed steps: it keeps captured states"
    assert out["segments_after_close"] == 0, "the closed client left its segments in /dev/shm"
    if capture == "auto":
        assert out["segments_open"] == 0, "a snapshot read in place made /dev/shm segments"
    assert mapped <= 16 * 9 * MiB, f"the daemon still maps {mapped / MiB:.0f} MiB of the trainer's freed segments"
    assert rss_after - rss_before < 160 * MiB, (
        f"the daemon grew {(rss_after - rss_before) / MiB:.0f} MiB over {steps} snapshots to new names")
    assert datastates.latest(root) == f"epoch_{steps - 1}"
    last = datastates.load(root / f"epoch_{steps - 1}" / "m.pt")
    assert torch.equal(last["w"], torch.full((2 << 20,), float(steps - 1)))
