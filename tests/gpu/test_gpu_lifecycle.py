"""The GPU path at its limits: many storages, expandable segments, a killed copy, a full GPU.

Each test is built to fail on the behaviour it guards: the 1,500-storage snapshot must
return while the trainer's stream still runs a kernel queued before it (torch synchronizes
that stream on each share past 1,000 live events, unless the share runs elsewhere); the
expandable-segment tests fail if one storage the daemon cannot open fails the snapshot;
the killed trainer is killed while its copy runs (the test fails if it could not be); the
full-GPU test starts a daemon whose pool is not pinned, so that only a context made at the
daemon's start, not one made at the first probe, keeps the trainer's memory its own.
Trainers run as processes of their own (``run_child``, ``start_child``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from datastates.client import Client, daemon_status
from datastates.protocol.errors import SharedMemoryError

from conftest import DaemonProc, reap, save
from gpu.test_gpu_path import checkpoint, file_of, gpu_sleep, settle, sha, to_cpu, warm_up

STORAGES = 1500
"""Past torch's 1,000 live IPC events (CUDA_IPC_MAXIMUM_EVENTS_TO_USE)."""
SHARE_BUSY_S = 2.0
"""GPU sleep queued before the 1,500-storage snapshot: 1,500 shares take a small fraction of it."""
CHUNK = 64 << 20
"""The full-GPU trainer's allocations: it gives three back before its first snapshot and takes two again after.
The spare one holds the probe's small-pool segment; 192 MiB is less than any CUDA context takes."""


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    return shared_daemon_folder


def set_expandable(on: bool) -> None:
    """Switch the caching allocator's expandable segments at run time (new segments only)."""
    setting = f"expandable_segments:{on}"
    if hasattr(torch._C, "_accelerator_setAllocatorSettings"):
        torch._C._accelerator_setAllocatorSettings(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


def paths_of(client: Any) -> dict[str, str]:
    return {str(k): v for k, v in client.gpu_capture_paths.items()}


# -- 1,500 storages -------------------------------------------------------------------------


def trainer_of_many_storages(endpoint: str, root: str) -> dict[str, Any]:
    tensors = [torch.full((256,), float(i), device="cuda") for i in range(STORAGES)]
    with Client(endpoint, timeout=120, gpu_capture="ipc") as c:
        warm_up(c, root, "many")
        shared_before = c.cuda_shares  # the warm-up's own storage
        gpu_sleep(SHARE_BUSY_S)
        torch._foreach_add_(tensors, 1.0)
        handle = c.snapshot({"t": tensors}, file_of(root, "many"))
        busy = not torch.cuda.current_stream().query()
        c.wait()
        c.commit(handle.tag).result(timeout=120)
        return {"busy": busy, "shares": c.cuda_shares - shared_before}


@pytest.mark.timeout(120)
def test_a_state_of_1500_storages_is_shared_without_waiting_for_the_trainers_stream(
        run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    run = run_child(trainer_of_many_storages, daemon.endpoint, str(daemon.root), timeout=100)
    assert run["busy"], "snapshot() of 1,500 new storages returned only once the GPU queue had drained"
    assert run["shares"] == STORAGES, run
    loaded = torch.stack(checkpoint(file_of(daemon.root, "many"))["t"])
    expected = torch.arange(1, STORAGES + 1, dtype=torch.float32)[:, None].expand(STORAGES, 256)
    assert torch.equal(loaded, expected), "the checkpoint of 1,500 storages holds other values"


# -- expandable segments ----------------------------------------------------------------------


def trainer_switching_to_expandable_segments(endpoint: str, root: str) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(1)
    old = torch.randn(1 << 20, generator=g, device="cuda")
    with Client(endpoint, timeout=120) as c:
        warm_up(c, root, "switch")  # probed in an ordinary segment: this device goes by CUDA IPC
        set_expandable(True)
        new = torch.randn(1 << 24, generator=g, device="cuda")  # 64 MiB: a new segment, an expandable one
        save(c, {"old": old, "new": new}, file_of(root, "switch"))
        return {"paths": paths_of(c), "sha": {"old": sha(old), "new": sha(new)}}


def test_a_storage_in_an_expandable_segment_is_copied_by_the_trainer_alone(
        run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    """The allocator switched to expandable segments at run time: the daemon never opens such a handle, and
    that one storage must reach the checkpoint through the trainer's host copy, the others by CUDA IPC."""
    run = run_child(trainer_switching_to_expandable_segments, daemon.endpoint, str(daemon.root))
    assert set(run["paths"].values()) == {"ipc"}, run["paths"]
    loaded = checkpoint(file_of(daemon.root, "switch"))
    assert {k: sha(v) for k, v in loaded.items()} == run["sha"]


def trainer_with_expandable_segments(endpoint: str, root: str) -> dict[str, Any]:
    set_expandable(True)  # before any allocation, as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True does
    g = torch.Generator(device="cuda").manual_seed(2)
    state = {"w": torch.randn(1 << 20, generator=g, device="cuda"), "b": torch.randn(100, generator=g, device="cuda")}
    with Client(endpoint, timeout=120) as c:
        save(c, state, file_of(root, "expandable"))
        return {"paths": paths_of(c), "sha": {k: sha(v) for k, v in state.items()}}


def test_a_trainer_on_expandable_segments_falls_back_to_host_copies(
        run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    run = run_child(trainer_with_expandable_segments, daemon.endpoint, str(daemon.root))
    loaded = checkpoint(file_of(daemon.root, "expandable"))
    assert {k: sha(v) for k, v in loaded.items()} == run["sha"]
    assert all(p == "ipc" or p.startswith("host: ") for p in run["paths"].values()), run["paths"]


def trainer_on_ipc_only_meeting_an_expandable_segment(endpoint: str, root: str) -> str:
    with Client(endpoint, timeout=120, gpu_capture="ipc") as c:
        warm_up(c, root, "ipc-only")  # probed in an ordinary segment: this device goes by CUDA IPC
        set_expandable(True)
        new = torch.randn(1 << 24, device="cuda")  # 64 MiB: a new segment, an expandable one
        try:
            c.snapshot({"new": new}, file_of(root, "ipc-only"))
        except SharedMemoryError as exc:
            return exc.message
        return ""


def test_gpu_capture_ipc_refuses_a_storage_it_cannot_share_instead_of_copying_it_to_host(
        run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    """``gpu_capture="ipc"`` promises CUDA IPC or an error: a storage in an expandable segment raises."""
    refused = run_child(trainer_on_ipc_only_meeting_an_expandable_segment, daemon.endpoint, str(daemon.root))
    assert "expandable segment" in refused, refused


# -- a trainer killed while the daemon copies its GPU memory ------------------------------------


def trainer_killed_mid_copy(endpoint: str, root: str) -> None:
    """Snapshot 2 GiB, and die (SIGKILL) once the daemon has copied part of it, not all."""
    x = torch.full((1 << 29,), 3.0, device="cuda")
    c = Client(endpoint, timeout=120)
    warm_up(c, root, "midcopy")
    path = str(file_of(root, "midcopy"))
    c.snapshot({"x": x}, path)
    deadline, seen = time.monotonic() + 30, "LATE"
    while time.monotonic() < deadline:
        job = next((j for j in daemon_status(endpoint)["snapshots"] if j["path"] == path), None)
        if job is not None and 0 < job["copied_bytes"] < job["total_bytes"]:
            seen = "MIDCOPY"
            break
        if job is not None and job["copied_bytes"] == job["total_bytes"]:
            break
        time.sleep(0.002)
    print(seen, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(150)
def test_a_trainer_killed_mid_copy_fails_its_snapshot_and_the_gpu_still_serves_another_client(
        start_child: Callable[..., subprocess.Popen], start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """A small pool flushed to disk makes the 2 GiB copy last seconds. Whatever the driver does with memory a dead
    process owned, the snapshot fails (its trainer died before its state was copied), the daemon says how its
    context on that GPU is (``status``: held, or broken by a sticky error), and another client's GPU snapshot
    is whole: by CUDA IPC on a sound context, by its own host copy on a broken one."""
    d = start_daemon(storage={"roots": [str(tmp_path / "ckpt")]}, memory_restore="none", host_memory="128MiB",
                     chunk_size="16MiB")
    proc = start_child(trainer_killed_mid_copy, d.endpoint, str(d.root))
    assert proc.stdout is not None
    seen = proc.stdout.readline().strip()
    assert proc.wait(60) == -signal.SIGKILL
    assert seen == "MIDCOPY", f"the trainer was not killed during its copy ({seen}): the test proves nothing"
    path = str(file_of(d.root, "midcopy"))

    def job() -> dict[str, Any] | None:
        return next((j for j in daemon_status(d.endpoint)["snapshots"] if j["path"] == path), None)

    settled = settle(job, lambda j: j is not None and j["state"] in ("failed", "durable"), within=60)
    assert settled is not None and settled["state"] == "failed", settled
    assert not Path(path).exists()
    state = {"w": torch.randn(1 << 22, device="cuda")}
    with Client(d.endpoint, timeout=120) as c:
        save(c, state, file_of(d.root, "after"))
        paths = c.gpu_capture_paths
    gpus = daemon_status(d.endpoint)["daemon"]["gpus"]  # after: a broken context shows at its next use
    assert gpus and all(g["context"] == "held" or g["context"].startswith("broken: ") for g in gpus), gpus
    broken = any(g["context"].startswith("broken: ") for g in gpus)
    assert all(p.startswith("host: ") if broken else p == "ipc" for p in paths.values()), (gpus, paths)
    assert torch.equal(checkpoint(file_of(d.root, "after"))["w"], to_cpu(state)["w"])


# -- a daemon's contexts, made before the trainers fill their GPUs --------------------------------


def trainer_filling_the_gpu(endpoint: str, root: str) -> dict[str, Any]:
    """Hold all the GPU's memory but three chunks, then snapshot (the first on this device) and take two back."""
    state = {"w": torch.randn(1 << 20, device="cuda")}
    held = []
    try:
        while True:
            held.append(torch.empty(CHUNK, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError:
        pass
    del held[-3:]
    torch.cuda.empty_cache()  # three chunks' worth free on the device, no more
    with Client(endpoint, timeout=120) as c:
        save(c, state, file_of(root, "full"))
        path = c.gpu_capture_paths[torch.cuda.current_device()]
    try:
        held += [torch.empty(CHUNK, dtype=torch.uint8, device="cuda") for _ in range(2)]
        refilled = True
    except torch.OutOfMemoryError:
        refilled = False
    return {"path": path, "refilled": refilled, "chunks": len(held), "sha": sha(state["w"])}


@pytest.mark.timeout(200)
def test_the_daemon_takes_its_gpu_context_at_start_so_a_full_trainer_keeps_its_memory(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, run_child: Callable[..., Any],
        record_property: Callable[[str, object], None]) -> None:
    """Its pool unpinned (pinning would make a context on its own), the daemon holds a context on every GPU
    soon after it starts, before any trainer; its footprint there is recorded for the device check. A trainer
    then holding all but 192 MiB of the GPU gets its first snapshot by CUDA IPC, and 128 MiB of it back after."""
    reap(block=True)  # earlier tests' daemons gone: their contexts must not leave the GPU during the reading
    torch.cuda.init()
    free_before, _ = torch.cuda.mem_get_info()
    d = start_daemon(storage={"roots": [str(tmp_path / "ckpt")]}, memory_restore="none", pin_host_memory=False)
    gpus = settle(lambda: daemon_status(d.endpoint)["daemon"].get("gpus", []),
                  lambda g: len(g) == torch.cuda.device_count() and all(x["context"] == "held" for x in g), within=60)
    assert len(gpus) == torch.cuda.device_count() and all(g["context"] == "held" for g in gpus), gpus
    footprint = free_before - torch.cuda.mem_get_info()[0]
    record_property("daemon_gpu_footprint_mib", round(footprint / 2**20))  # bench/gpu_check.sh reports it
    assert 0 < footprint < 2 << 30, f"the daemon took {footprint} bytes of cuda:0 at start"
    run = run_child(trainer_filling_the_gpu, d.endpoint, str(d.root), timeout=180)
    assert run["path"] == "ipc", f"the first snapshot of a full GPU went another way: {run['path']}"
    assert run["refilled"], "the trainer could not take back its own 128 MiB after its first snapshot"
    assert sha(checkpoint(file_of(d.root, "full"))["w"]) == run["sha"]
