"""The GPU path end to end: CUDA IPC descriptions, the daemon's region and copy, and checkpoints of GPU state.

The daemon-level tests need the wiring of issue 6 (the client's CUDA capturer, the
daemon's ``cuda_ipc`` source and its copy stream); the unit tests need only the new modules.
"""

from __future__ import annotations

import hashlib
import mmap
import subprocess
import sys
import time
from typing import Any, Callable

import msgpack
import torch

import datastates
from datastates.client import daemon_status
from datastates.client.cuda import describe_cuda_storage, encode_handle, snapshot_event
from datastates.daemon.pinning import pin

from conftest import DaemonProc, assert_state_equal, same_storage, save

SLEEP_CYCLES = 4_000_000_000
"""A few seconds of GPU clock: a kernel still running when the snapshot is taken."""

CHILD_REGION = """
import gc, hashlib, mmap, sys, torch
from datastates.daemon.pinning import pin
from datastates.daemon.sources.cuda import CudaIpcSource, copy_to_host
from datastates.protocol.descriptors import SourceDesc
region = CudaIpcSource().open(SourceDesc(kind="cuda_ipc", handle=sys.argv[1], nbytes=int(sys.argv[2])))
host = torch.frombuffer(mmap.mmap(-1, region.nbytes), dtype=torch.uint8)
assert pin(host) and host.is_pinned()
stream = torch.cuda.Stream(region.device)
copy_to_host(region, 0, host, region.nbytes, stream).synchronize()
print(hashlib.sha256(host.numpy().tobytes()).hexdigest())
del region; gc.collect()  # releases the trainer's ref-counter slot
"""

CHILD_RANK = """
import sys, torch
from datastates.client import Client
from datastates.protocol.descriptors import Ranks
rank, endpoint, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
g = torch.Generator(device="cuda").manual_seed(rank)
state = {"w": torch.randn(1 << 20, generator=g, device="cuda"), "rank": rank}
with Client(endpoint, timeout=120, ranks=Ranks(rank=rank, local_rank=rank, world_size=2, local_world_size=2, job="g")) as c:
    c.snapshot(state, path)
    c.wait()
    c.commit("step1").result(timeout=300)
"""


def to_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to("cpu")
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    return state


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


# -- units: the client's description, the daemon's region, pinning ------------------------


def test_describe_cuda_storage_names_the_block_offset_and_device() -> None:
    tensors = [torch.full((64,), float(i), device="cuda") for i in range(8)]  # small: several share one block
    descs = [describe_cuda_storage(t.untyped_storage()) for t in tensors]
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    for d in descs:
        assert d["uuid"] == uuid and d["nbytes"] == 256 and d["block"] and d["offset"] >= 0
        assert msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False) == d
    assert any(d["offset"] > 0 for d in descs), "every storage at offset 0: none sits inside a shared block"
    assert len({(d["block"], d["offset"]) for d in descs}) == len(descs)


def test_region_opened_in_a_second_process_reads_the_kernels_result(run_child: Callable[..., str]) -> None:
    pad = torch.empty(1000, device="cuda")  # noqa: F841  (puts x at a nonzero offset in its block)
    x = torch.arange(4096, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.mul_(3)  # queued behind the sleep: still pending when the event is recorded
    keep: list[Any] = []
    desc = describe_cuda_storage(x.untyped_storage())
    handle = encode_handle(desc, snapshot_event(keep))
    assert desc["offset"] > 0
    got = run_child(CHILD_REGION, handle, str(desc["nbytes"]))
    assert got == sha(torch.arange(4096, dtype=torch.int32) * 3)


def test_pin_registers_a_mapped_chunk_once() -> None:
    host = torch.frombuffer(mmap.mmap(-1, 4 << 20), dtype=torch.uint8)
    assert not host.is_pinned()
    assert pin(host) and pin(host) and host.is_pinned()  # a second pin is a no-op, not a CUDA error


# -- end to end, through a daemon -----------------------------------------------------------


def test_gpu_state_round_trips_bitwise(client: Any, daemon: DaemonProc) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 1000, generator=g, device="cuda")
    state = {
        "w": w,
        "view": w[10:20],
        "bf16": torch.randn(3, 4097, generator=g, device="cuda").to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (777,), generator=g, device="cuda"),
        "strided": torch.randn(64, 64, generator=g, device="cuda").t(),
        "empty": torch.empty(0, device="cuda"),
        "cpu": torch.randn(100),
        "step": 3,
    }
    path = daemon.root / "gpu1" / "model_states.pt"
    save(client, state, path)
    loaded = datastates.load(path, map_location="cpu")
    assert_state_equal(to_cpu(state), loaded)
    assert same_storage(loaded["w"], loaded["view"])


def test_a_kernel_queued_before_snapshot_is_in_the_checkpoint(client: Any, daemon: DaemonProc) -> None:
    x = torch.zeros(1 << 24, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    x.fill_(7.0)  # still queued when snapshot() returns
    path = daemon.root / "gpu2" / "model_states.pt"
    save(client, {"x": x}, path)
    assert torch.equal(datastates.load(path, map_location="cpu")["x"], torch.full((1 << 24,), 7.0))


def test_a_change_after_wait_is_not_in_the_checkpoint(client: Any, daemon: DaemonProc) -> None:
    x = torch.full((1 << 24,), 5.0, device="cuda")
    path = daemon.root / "gpu3" / "model_states.pt"
    handle = client.snapshot({"x": x}, path)
    client.wait()
    x.fill_(9.0)  # the optimizer step: the daemon holds its own copy by now
    client.commit(handle.tag).result(timeout=120)
    assert torch.equal(datastates.load(path, map_location="cpu")["x"], torch.full((1 << 24,), 5.0))


def test_two_ranks_share_one_gpu(daemon: DaemonProc) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD_RANK, str(r), daemon.endpoint,
                          str(daemon.root / "step1" / f"rank{r}.pt")], stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert datastates.latest(daemon.root) == "step1"
    for r in range(2):
        g = torch.Generator(device="cuda").manual_seed(r)
        expected = {"w": torch.randn(1 << 20, generator=g, device="cuda").cpu(), "rank": r}
        assert_state_equal(expected, datastates.load(daemon.root / "step1" / f"rank{r}.pt", map_location="cpu"))


CHILD_EXITS = """
import os, sys, time, torch
from datastates.client import Client
endpoint, path, how = sys.argv[1], sys.argv[2], sys.argv[3]
x = torch.full((1 << 26,), 3.0, device="cuda")  # 256 MiB
c = Client(endpoint, timeout=120)
if how == "killed":  # dies before the daemon can have copied: the copy waits behind a long kernel
    torch.cuda._sleep(40_000_000_000)
    x.add_(1.0)
    c.snapshot({"x": x}, path)
    print("SENT", flush=True)
    time.sleep(1)
    os.kill(os.getpid(), 9)
c.snapshot({"x": x}, path)
c.wait()
c.commit("exits").result(timeout=300)
os._exit(0)  # no close(), no BYE: the daemon notices by itself
"""


def test_a_trainer_that_exits_after_wait_leaves_its_checkpoint_and_no_held_regions(daemon: DaemonProc) -> None:
    path = daemon.root / "exits" / "model_states.pt"
    subprocess.run([sys.executable, "-c", CHILD_EXITS, daemon.endpoint, str(path), "exits"], check=True, timeout=300)
    assert datastates.latest(daemon.root) == "exits"
    assert torch.equal(datastates.load(path, map_location="cpu")["x"], torch.full((1 << 26,), 3.0))
    for _ in range(600):  # a hang guard: the daemon drops the exited trainer within client_timeout
        st = daemon_status(daemon.endpoint)
        if not st["clients"]:
            break
        time.sleep(0.1)
    assert not st["clients"] and st["clients_lost"][-1]["how"] == "exited", st


def test_a_trainer_killed_before_its_gpu_copy_never_commits_bytes_from_before_its_snapshot(
        daemon: DaemonProc, client: Any) -> None:
    """The trainer dies while a kernel queued before its snapshot still runs; others are served.

    Where the driver aborts a dead process's kernels, the snapshot's event may complete
    without their results: the daemon must fail the snapshot (its trainer is gone when the
    copy ends). Where they drain before the process is gone (seen under gVisor, H200), the
    copy holds their results and the snapshot may be durable. Either way no committed file
    holds the bytes from before the kernels ran (3.0).
    """
    path = daemon.root / "killed" / "model_states.pt"
    proc = subprocess.Popen([sys.executable, "-c", CHILD_EXITS, daemon.endpoint, str(path), "killed"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "SENT"
    assert proc.wait(120) == -9
    for _ in range(1200):  # a hang guard, not a timing check
        jobs = [j for j in daemon_status(daemon.endpoint)["snapshots"] if j["path"] == str(path)]
        if jobs and jobs[0]["state"] in ("failed", "durable"):
            break
        time.sleep(0.1)
    assert jobs and jobs[0]["state"] in ("failed", "durable"), jobs
    if jobs[0]["state"] == "failed":
        assert not path.exists()
    else:
        assert torch.equal(datastates.load(path, map_location="cpu")["x"], torch.full((1 << 26,), 4.0))
    state = {"w": torch.randn(1 << 20, device="cuda")}
    save(client, state, daemon.root / "after" / "model_states.pt")
    assert_state_equal(to_cpu(state), datastates.load(daemon.root / "after" / "model_states.pt", map_location="cpu"))


def test_the_daemon_does_not_keep_freed_trainer_memory_alive(client: Any, daemon: DaemonProc) -> None:
    """Each snapshot's blocks are released once copied: ten 256 MiB checkpoints do not grow the trainer's memory."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    for step in range(10):
        x = torch.full((1 << 26,), float(step), device="cuda")
        save(client, {"x": x}, daemon.root / f"mem{step}" / "model_states.pt")
        del x
        torch.cuda.ipc_collect()  # frees blocks whose ref-counter slot the daemon released
        torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() - base < 2 * (256 << 20), (base, torch.cuda.memory_reserved())
