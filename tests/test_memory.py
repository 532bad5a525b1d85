"""The host-memory budget: a state larger than it streams through, and the daemon never holds more than it."""

from __future__ import annotations

import time
from typing import Callable

import torch

import datastates
from datastates.client import Client

from conftest import DaemonProc, assert_state_equal, save

MiB = 1 << 20


def test_snapshot_larger_than_the_budget(start_daemon: Callable[..., DaemonProc]) -> None:
    """~40 MB through an 8 MiB pool of 1 MiB chunks: the file is whole and the pool's peak stays within budget."""
    daemon: DaemonProc = start_daemon(host_memory="8MiB", chunk_size="1MiB")
    g = torch.Generator().manual_seed(0)
    state = {
        "embed": torch.randn(5 * MiB, generator=g),  # 20 MiB on its own, 2.5x the whole budget
        "blocks": [torch.randn(MiB + 123, generator=g) for _ in range(3)],  # sizes that do not fall on chunk borders
        "bf16": torch.randn(2 * MiB, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 62, (MiB // 2,), generator=g),
        "tiny": torch.tensor(3.0),
    }
    path = daemon.root / "global_step1" / "model_states.pt"
    with Client(daemon.endpoint, timeout=60) as client:
        handle = client.snapshot(state, path)
        assert handle.nbytes > 4 * 8 * MiB
        client.wait()
        client.commit("global_step1").result(timeout=120)
        mem = client.status()["daemon"]["host_memory"]

    assert_state_equal(state, datastates.load(path))
    assert mem["budget_bytes"] == 8 * MiB and mem["chunk_size"] == MiB
    assert 0 < mem["peak_in_use_bytes"] <= mem["budget_bytes"]
    assert mem["chunks_allocated"] <= 8 and mem["chunks_in_use"] == 0, "every chunk is back in the pool"


def test_many_tiny_tensors(client: Client, daemon: DaemonProc) -> None:
    """500 tensors of 1 to 64 bytes, each its own storage, share pieces of the file and all come back."""
    g = torch.Generator().manual_seed(1)
    dtypes = [torch.uint8, torch.int16, torch.float32, torch.float64, torch.bfloat16, torch.bool]
    tensors = {}
    for i in range(500):
        dtype = dtypes[i % len(dtypes)]
        n = int(torch.randint(1, 64 // dtype.itemsize + 1, (1,), generator=g))
        tensors[f"t{i:03d}"] = torch.empty(n * dtype.itemsize, dtype=torch.uint8).random_(generator=g).view(dtype)
    assert all(1 <= t.untyped_storage().nbytes() <= 64 for t in tensors.values())

    committed = save(client, {"tensors": tensors, "count": len(tensors)}, daemon.root / "global_step2" / "tiny.pt")

    loaded = datastates.load(committed.files[0])
    assert_state_equal({"tensors": tensors, "count": 500}, loaded)


def test_a_snapshot_taken_while_a_fresh_daemon_maps_its_pool_is_whole_and_the_pool_stays_in_budget(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """A fresh daemon maps its pool in the background, only between copies (daemon/memory.py): a snapshot taken at
    once copies into the chunks mapped so far and maps the others it needs itself. The file is whole, and the pool
    ends fully mapped, never past host_memory."""
    daemon = start_daemon(host_memory="2GiB", chunk_size="1MiB", prefault=True)
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(3 * MiB // 16 + i, generator=g) for i in range(160)}  # 120 MiB, odd sizes
    path = daemon.root / "global_step1" / "model_states.pt"
    with Client(daemon.endpoint, timeout=60) as client:
        mem = client.status()["daemon"]["host_memory"]
        capacity = mem["budget_bytes"] // mem["chunk_size"]
        assert mem["chunks_allocated"] < capacity, "the pool was mapped before the snapshot: nothing was tested"
        client.snapshot(state, path)
        client.wait()
        client.commit("global_step1").result(timeout=120)
        seen = []
        for _ in range(600):
            mem = client.status()["daemon"]["host_memory"]
            seen.append(mem["chunks_allocated"])
            if seen[-1] >= capacity:
                break
            time.sleep(0.1)
        time.sleep(1)  # whatever mapping was under way has ended
        seen.append(client.status()["daemon"]["host_memory"]["chunks_allocated"])
    assert max(seen) == seen[-1] == capacity, f"the pool ended with {seen[-1]} of {capacity} chunks mapped, at most {max(seen)}"
    assert_state_equal(state, datastates.load(path))
