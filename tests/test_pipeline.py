"""The streaming pipeline as a trainer meets it: the fence hook, bounded memory, any file system."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

import datastates
from datastates.client import Client
from datastates.client.reader.stream import verify

from conftest import DaemonProc, assert_state_equal, save


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc (the kernel's own count)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_protect_fences_the_optimizer_step(client: Client, daemon: DaemonProc) -> None:
    """With protect(), a step taken right after snapshot() waits for the copy: the file holds the pre-step weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    client.protect(opt)
    for _ in range(2):
        model(torch.randn(32, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(32, 256)).square().mean().backward()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    before = copy.deepcopy({"model": state["model"], "optimizer": state["optimizer"]["state"]})
    handle = client.snapshot(state, daemon.root / "global_step3" / "model_states.pt")
    opt.step()  # no explicit wait(): the hook must fence it
    assert not torch.equal(model[0].weight, before["model"]["0.weight"]), "the step changed nothing; the test proves nothing"
    client.commit(handle.tag).result(timeout=120)
    loaded = datastates.load(handle.path)
    assert_state_equal(before["model"], loaded["model"])
    assert_state_equal(before["optimizer"], loaded["optimizer"]["state"])


def test_wait_returns_only_once_the_daemon_holds_its_own_copy(start_daemon: Callable[..., DaemonProc]) -> None:
    """The step taken the moment ``wait()`` returns never reaches the file.

    256 MiB through an 8 MiB pool: the copy runs long after admission (each chunk waits for
    a write), so a WAIT answered before the daemon held every byte would let the step race it.
    """
    d = start_daemon(host_memory="8MiB", chunk_size="4MiB")
    one = torch.tensor(1.0).view(torch.int32).item()  # the bits of 1.0f
    t = torch.full((64 << 20,), 1.0)
    with Client(d.endpoint, timeout=120) as c:
        handle = c.snapshot({"t": t}, d.root / "step1" / "model_states.pt")
        c.wait()
        t.fill_(2.0)  # the optimizer step, at once
        c.commit(handle.tag).result(timeout=300)
    loaded = datastates.load(handle.path)["t"]
    assert loaded.shape == t.shape
    changed = int(loaded.view(torch.int32).ne(one).sum())
    assert changed == 0, f"{changed} of {loaded.numel()} elements in the file are not the pre-step value 1.0"


def test_host_memory_stays_flat_over_50_checkpoints(start_daemon: Callable[..., DaemonProc]) -> None:
    """The pool is mapped once and reused: 50 checkpoints leave the daemon's RSS where 10 did. Without replicas,
    whose pages the daemon maps and locks as they come and go (tests/test_soak.py holds them to a bound)."""
    d = start_daemon(host_memory="16MiB", chunk_size="1MiB", memory_restore="none")
    state = {f"w{i}": torch.randn(1 << 18) for i in range(24)}  # 24 MiB: streams through a 16 MiB pool
    rss = []
    with Client(d.endpoint, timeout=120) as c:
        for step in range(50):
            for t in state.values():
                t.add_(1)
            save(c, state, d.root / f"s{step}" / "model_states.pt", tag=f"s{step}")
            rss.append(rss_bytes(d.proc.pid))
        status = c.status()["daemon"]["host_memory"]
    assert status["chunks_allocated"] * status["chunk_size"] <= status["budget_bytes"]
    assert status["peak_in_use_bytes"] <= status["budget_bytes"]
    growth = rss[-1] - rss[9]
    assert growth < 8 << 20, f"daemon RSS grew {growth / 2**20:.1f} MiB from checkpoint 10 to 50: {[r >> 20 for r in rss]}"
    assert_state_equal(state, datastates.load(d.root / "s49" / "model_states.pt"))


def test_root_without_o_direct_falls_back_to_buffered_writes(start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """tmpfs refuses O_DIRECT; the daemon writes through the page cache there and the file is the same."""
    shm_root = Path(tempfile.mkdtemp(prefix="ds-tmpfs-", dir="/dev/shm"))
    try:
        d = start_daemon(storage={"roots": [str(tmp_path / "ckpt"), str(shm_root)]})
        state: dict[str, Any] = {"w": torch.randn(3, 1000, dtype=torch.bfloat16), "odd": torch.arange(7, dtype=torch.int8), "step": 3}
        with Client(d.endpoint, timeout=60) as c:
            save(c, state, shm_root / "t1" / "model_states.pt")
        path = shm_root / "t1" / "model_states.pt"
        verify(path)  # every checksum, local header and the central directory as its index says
        assert_state_equal(state, datastates.load(path))
        assert datastates.latest(shm_root) == "t1"
    finally:
        for p in sorted(shm_root.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
        shm_root.rmdir()
