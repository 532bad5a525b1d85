"""The GPU path end to end, through a real daemon: ordering, the WAIT fence, a long run, each capture path.

Each test is built so that it can fail. The kernels that must be ordered are still queued
when ``snapshot()`` returns (the tests assert it), and a control run without the snapshot's
fence must see the old values; ``wait()`` is raced by a change far faster than the copy;
the long run queues a step of GPU work before each snapshot, so a ``snapshot()`` that
synchronizes pays for it. Trainers that must be processes of their own (CUDA IPC cannot
open a block in the process that made it; killed, exiting, several ranks, a patched client)
run the functions below in a child process (``run_child``, ``start_child``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import torch

import datastates
import datastates.client.capture as client_capture
from datastates.client import Client, daemon_status
from datastates.protocol.descriptors import Ranks

from conftest import DaemonProc, assert_state_equal, same_storage, save

BUSY_S = 6.0
"""GPU sleep queued before an update kernel: far longer than any copy or reply, so a missing fence shows."""
STEP_S = 0.02
"""The long run's step of GPU work, queued before each snapshot: a ``snapshot()`` that synchronizes waits for it."""
CALIBRATION_CYCLES = 500_000_000
"""A quarter second of sleep at an H200's clock: long enough to time, after as long a warm-up to raise the clock."""
OLD, NEW = 1.0, 2.0
LAYERS = 32
"""The long run's model: 32 Linear(64, 64) layers, 64 long-lived parameters, most sharing allocator blocks."""
SNAPSHOTS, GROUP, EARLY = 400, 100, 10
"""The long run: snapshots, how many go to one tag (committed together), and after how many memory is taken as settled."""
IDLE_SHARE = 0.01
"""The long run's snapshots allowed to find the trainer's stream idle when they return (a collector pause longer
than a step); one that synchronizes finds it idle every time."""


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder


# -- helpers, in the test process and in the trainers it starts --------------------------


@functools.cache
def cycles_per_second() -> float:
    """The GPU clock as ``torch.cuda._sleep`` counts it, timed with CUDA events (clocks differ between GPUs and boosts)."""
    torch.cuda._sleep(CALIBRATION_CYCLES)  # the first launch, and the clock up from idle
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)


def gpu_sleep(seconds: float) -> None:
    """Queue ``seconds`` of GPU work on the current stream; returns at once."""
    torch.cuda._sleep(int(seconds * cycles_per_second()))


def file_of(root: str | Path, tag: str) -> Path:
    return Path(root) / tag / "model_states.pt"


def warm_up(client: Any, root: str | Path, tag: str) -> None:
    """One small GPU snapshot first: the client's probe of a device reads its tensor back (a synchronize), which
    must be done before a test queues its long kernel."""
    save(client, {"warm": torch.zeros(1, device="cuda")}, file_of(root, f"{tag}-warm"))


def checkpoint(path: str | Path) -> Any:
    return datastates.load(path, map_location="cpu")


def to_cpu(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to("cpu")
    if isinstance(state, dict):
        return {k: to_cpu(v) for k, v in state.items()}
    if isinstance(state, list):
        return [to_cpu(v) for v in state]
    return state


def cuda_storages(state: Any) -> set[int]:
    """The non-empty CUDA storages ``state`` holds (views of one count once), by address."""
    if isinstance(state, torch.Tensor):
        return {state.untyped_storage().data_ptr()} if state.is_cuda and state.untyped_storage().nbytes() else set()
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else []
    return set().union(*(cuda_storages(v) for v in values))


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def gpu_memory() -> list[int]:
    """This process's GPU memory: [allocated, reserved] bytes."""
    return [torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]


def client_status(endpoint: str, client_id: str) -> dict[str, Any]:
    return next(c for c in daemon_status(endpoint)["clients"] if c["id"] == client_id)


def settle(read: Callable[[], Any], done: Callable[[Any], bool], within: float) -> Any:
    """``read()`` until ``done`` says so or ``within`` seconds pass (a hang guard, not a timing check); its last value."""
    deadline = time.monotonic() + within
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def mixed_gpu_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1000, 1000, generator=g, device="cuda")
    return {
        "w": w,
        "view": w[10:20],
        "bf16": torch.randn(3, 4097, generator=g, device="cuda").to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (777,), generator=g, device="cuda"),
        "strided": torch.randn(64, 64, generator=g, device="cuda").t(),
        "empty": torch.empty(0, device="cuda"),
        "small": [torch.full((64,), float(i), device="cuda") for i in range(8)],  # one allocator block, at offsets
        "cpu": torch.randn(100),
        "step": 3,
    }


# -- every capture path, bitwise -------------------------------------------------------------


@pytest.mark.parametrize("capture, path", [("auto", "ipc"), ("host", "host: ")], ids=["auto", "host"])
def test_gpu_state_round_trips_bitwise_by_each_capture_path(capture: str, path: str, daemon: DaemonProc) -> None:
    """``auto`` takes CUDA IPC where the daemon can open the trainer's handles (an H200 can); ``host`` never does,
    and its checkpoint is the same, bit for bit. IPC shares each storage once (views of one count once), host none."""
    state = mixed_gpu_state()
    with Client(daemon.endpoint, timeout=60, gpu_capture=capture) as c:
        gpu_sleep(0.5)
        state["w"].mul_(2)  # queued behind the sleep when snapshot() is called: in the checkpoint all the same
        save(c, state, file_of(daemon.root, capture))
        paths, shares = c.gpu_capture_paths, c.cuda_shares
        seen = client_status(daemon.endpoint, c.client_id)["gpu_capture"]
    loaded = checkpoint(file_of(daemon.root, capture))
    assert_state_equal(to_cpu(state), loaded)
    assert same_storage(loaded["w"], loaded["view"])
    assert list(paths) == [torch.cuda.current_device()] and paths[torch.cuda.current_device()].startswith(path), paths
    assert shares == (len(cuda_storages(state)) if path == "ipc" else 0)
    assert set(seen.values()) == ({"ipc"} if path == "ipc" else set()), f"the daemon's view of this client: {seen}"


def test_the_daemons_pool_is_page_locked(client: Any, daemon: DaemonProc) -> None:
    """Device-to-host copies run at the link's speed only into page-locked memory: status says it is."""
    save(client, {"x": torch.ones(1 << 20, device="cuda")}, file_of(daemon.root, "pinned"))
    pool = daemon_status(daemon.endpoint)["daemon"]["host_memory"]
    assert pool["pin_error"] == "" and pool["chunks_pinned"] == pool["chunks_allocated"] > 0, pool


# -- ordering: the snapshot's fence, and a control run without it --------------------------


def no_fences(devices: Iterable[int], keepalive: list[Any]) -> list[Any]:
    """``record_fences`` of a client that skips the fence (the control run): the daemon copies at once."""
    return []


def trainer_behind_a_long_kernel(endpoint: str, root: str, tag: str, fenced: str) -> dict[str, bool]:
    """Snapshot a tensor whose update is queued behind BUSY_S of GPU sleep; ``fenced`` "no": without the fence."""
    if fenced == "no":  # the name snapshot() calls (client/capture.py imports it from client/cuda.py)
        client_capture.record_fences = no_fences
    x = torch.full((1 << 24,), OLD, device="cuda")
    with Client(endpoint, timeout=120, gpu_capture="ipc") as c:
        warm_up(c, root, tag)
        gpu_sleep(BUSY_S)
        x.fill_(NEW)
        handle = c.snapshot({"x": x}, file_of(root, tag))
        busy = not torch.cuda.current_stream().query()
        c.wait()
        c.commit(handle.tag).result(timeout=120)
    return {"busy": busy}


@pytest.mark.timeout(150)
def test_a_kernel_queued_before_snapshot_is_in_the_checkpoint(run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    run = run_child(trainer_behind_a_long_kernel, daemon.endpoint, str(daemon.root), "fenced", "yes", timeout=120)
    assert run["busy"], "snapshot() returned only once the GPU queue had drained: nothing was left to order"
    assert torch.equal(checkpoint(file_of(daemon.root, "fenced"))["x"], torch.full((1 << 24,), NEW))


@pytest.mark.timeout(150)
def test_without_its_fence_the_daemon_copies_before_the_kernel(run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    """The control of the test above: the same trainer without the fence gets the old values, so the NEW values
    there come from the fence, not from a daemon slow enough to copy after the kernel by luck."""
    run = run_child(trainer_behind_a_long_kernel, daemon.endpoint, str(daemon.root), "unfenced", "no", timeout=120)
    assert run["busy"], "snapshot() returned only once the GPU queue had drained: nothing was left to order"
    assert torch.equal(checkpoint(file_of(daemon.root, "unfenced"))["x"], torch.full((1 << 24,), OLD)), \
        "without its fence the daemon still saw the update: the test above cannot tell ordered from lucky"


# -- the WAIT fence ---------------------------------------------------------------------------


def test_a_change_right_after_wait_is_not_in_the_checkpoint(client: Any, daemon: DaemonProc) -> None:
    """``wait()`` returns only once the daemon holds its own copy, so the optimizer's step right after is not saved.

    1 GiB through the daemon's 64 MiB pool takes far longer than the change, so a WAIT
    answered before the copy ended would let the change into the file.
    """
    n = 1 << 28  # int32: 1 GiB
    x = torch.arange(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    handle = client.snapshot({"x": x}, file_of(daemon.root, "mutated"))
    client.wait()
    copied = time.perf_counter()
    x.fill_(-1)  # the optimizer step
    torch.cuda.synchronize()
    changed = time.perf_counter()
    client.commit(handle.tag).result(timeout=300)
    assert changed - copied < (copied - start) / 10, \
        f"the change took {changed - copied:.3f} s, the copy {copied - start:.3f} s: an early reply could go unseen"
    assert torch.equal(checkpoint(file_of(daemon.root, "mutated"))["x"], torch.arange(n, dtype=torch.int32))


# -- a long run: memory, shares and snapshot() time stay flat ------------------------------


def trainer_of_long_lived_parameters(endpoint: str, root: str) -> dict[str, Any]:
    """SNAPSHOTS snapshots of one model, a step of GPU work and an update queued before each, GROUP per tag."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(LAYERS)]).cuda()
    params = list(model.parameters())
    times: list[float] = []
    idle = 0
    memory: dict[str, list[int]] = {}
    with Client(endpoint, timeout=120) as c, torch.no_grad():
        for i in range(SNAPSHOTS):
            gpu_sleep(STEP_S)
            torch._foreach_add_(params, 1.0)
            group, name = divmod(i, GROUP)
            path = Path(root) / f"g{group}" / f"s{name}.pt"
            start = time.perf_counter()
            c.snapshot({"model": model.state_dict(), "step": i}, path)  # new tensor objects, the same storages
            times.append(time.perf_counter() - start)
            idle += torch.cuda.current_stream().query()  # its step still queued, unless snapshot() waited for it
            c.wait()
            if name == GROUP - 1:
                c.commit(f"g{group}").result(timeout=120)
            if i == EARLY - 1:
                memory["early"] = gpu_memory()
        memory["end"] = gpu_memory()
        shares = c.cuda_shares
    return {"times": times, "idle": idle, **memory, "shares": shares, "storages": len(params), "last": str(path),
            "sha": {k: sha(v) for k, v in model.state_dict().items()}}


@pytest.mark.timeout(240)
def test_a_long_run_keeps_trainer_memory_shares_and_snapshot_time_flat(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, run_child: Callable[..., Any]) -> None:
    """400 snapshots of the same 64 parameters (each used to share every storage again, and past
    torch's 1,000 IPC events, reached by the 16th snapshot, every share synchronized the trainer's stream).
    Each ``snapshot()`` must return with the step queued before it still running."""
    d = start_daemon(storage={"roots": [str(tmp_path / "ckpt")], "keep_last": 2}, memory_restore="none")
    run = run_child(trainer_of_long_lived_parameters, d.endpoint, str(d.root), timeout=200)
    assert run["end"] == run["early"], \
        f"trainer GPU memory [allocated, reserved] was {run['early']} after {EARLY} snapshots, {run['end']} at the end"
    assert run["shares"] == run["storages"], f"{run['shares']} CUDA shares for {run['storages']} storages"
    assert run["idle"] <= IDLE_SHARE * SNAPSHOTS, \
        f"{run['idle']} of {SNAPSHOTS} snapshot() calls returned with the trainer's stream idle: they waited for it"
    first, last = statistics.median(run["times"][:100]), statistics.median(run["times"][-100:])
    # The one timing bound of these tests: a snapshot() that slows down over a run is the very symptom guarded
    # against, and a ratio of two medians of one run does not depend on how fast the machine is.
    assert last <= 3 * first + 0.002, f"snapshot() median {first * 1e3:.2f} ms over the first 100, " \
                                      f"{last * 1e3:.2f} ms over the last 100"
    assert {k: sha(v) for k, v in checkpoint(run["last"])["model"].items()} == run["sha"]


# -- several trainers, and trainers that go away ---------------------------------------------


def rank_weights(rank: int) -> torch.Tensor:
    return torch.randn(1 << 20, generator=torch.Generator(device="cuda").manual_seed(rank), device="cuda")


def rank_trainer(rank: str, endpoint: str, path: str) -> None:
    r = int(rank)
    ranks = Ranks(rank=r, local_rank=r, world_size=2, local_world_size=2, job="g")
    with Client(endpoint, timeout=120, ranks=ranks) as c:
        save(c, {"w": rank_weights(r), "rank": r}, path)


def test_two_ranks_share_one_gpu(start_child: Callable[..., subprocess.Popen], daemon: DaemonProc) -> None:
    procs = [start_child(rank_trainer, str(r), daemon.endpoint, str(daemon.root / "step1" / f"rank{r}.pt"))
             for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert datastates.latest(daemon.root) == "step1"
    for r in range(2):
        assert_state_equal({"w": rank_weights(r).cpu(), "rank": r}, checkpoint(daemon.root / "step1" / f"rank{r}.pt"))


def trainer_that_exits_after_wait(endpoint: str, root: str, tag: str) -> None:
    c = Client(endpoint, timeout=120)
    save(c, {"x": torch.full((1 << 26,), 3.0, device="cuda")}, file_of(root, tag))  # 256 MiB
    os._exit(0)  # no close(), no BYE: the daemon notices by itself


@pytest.mark.own_daemon
def test_a_trainer_that_exits_after_wait_leaves_its_checkpoint_and_no_held_regions(
        run_child: Callable[..., Any], daemon: DaemonProc) -> None:
    run_child(trainer_that_exits_after_wait, daemon.endpoint, str(daemon.root), "exits")
    assert datastates.latest(daemon.root) == "exits"
    assert torch.equal(checkpoint(file_of(daemon.root, "exits"))["x"], torch.full((1 << 26,), 3.0))
    st = settle(lambda: daemon_status(daemon.endpoint), lambda s: not s["clients"], within=60)
    assert not st["clients"] and st["clients_lost"][-1]["how"] == "exited", st


def trainer_killed_behind_a_long_kernel(endpoint: str, root: str, tag: str) -> None:
    """Snapshot a tensor whose update is queued behind BUSY_S of GPU sleep, and die (SIGKILL) a second later."""
    x = torch.full((1 << 26,), 3.0, device="cuda")  # 256 MiB
    c = Client(endpoint, timeout=120)
    warm_up(c, root, tag)
    gpu_sleep(BUSY_S)
    x.add_(1.0)
    c.snapshot({"x": x}, file_of(root, tag))
    print("SENT", flush=True)
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.own_daemon
@pytest.mark.timeout(80)
def test_a_trainer_killed_before_its_gpu_copy_never_commits_bytes_from_before_its_snapshot(
        start_child: Callable[..., subprocess.Popen], daemon: DaemonProc, client: Any) -> None:
    """The trainer dies while a kernel queued before its snapshot still runs; others are served.

    Where the driver aborts a dead process's kernels, the snapshot's event may complete
    without their results: the daemon must fail the snapshot (its trainer is gone when the
    copy ends). Where they drain before the process is gone (seen under gVisor, H200), the
    copy holds their results and the snapshot may be durable. Either way no committed file
    holds the bytes from before the kernels ran (3.0), and the daemon hangs on nothing.
    """
    path = file_of(daemon.root, "killed")
    proc = start_child(trainer_killed_behind_a_long_kernel, daemon.endpoint, str(daemon.root), "killed")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "SENT"
    assert proc.wait(45) == -signal.SIGKILL  # a driver may drain its kernels first

    def job() -> dict[str, Any] | None:
        return next((j for j in daemon_status(daemon.endpoint)["snapshots"] if j["path"] == str(path)), None)

    settled = settle(job, lambda j: j is not None and j["state"] in ("failed", "durable"), within=40)
    assert settled is not None and settled["state"] in ("failed", "durable"), settled
    if settled["state"] == "failed":
        assert not path.exists()
    else:
        assert torch.equal(checkpoint(path)["x"], torch.full((1 << 26,), 4.0))
    state = {"w": torch.randn(1 << 20, device="cuda")}
    save(client, state, file_of(daemon.root, "after"))
    assert_state_equal(to_cpu(state), checkpoint(file_of(daemon.root, "after")))


def test_tensors_made_for_each_snapshot_go_back_to_the_allocator_without_ipc_collect(
        client: Any, daemon: DaemonProc) -> None:
    """A tensor made for one state dict (a clone, a cast) and freed after ``wait()`` must not
    stay held by the daemon until the next snapshot. The trainer's allocator is capped so that a second such
    tensor fits only if the first one's block came back: with its slot still at 1 the allocator can neither
    reuse it nor free it in its out-of-memory path (``CudaIPCCollect``), and the next allocation fails. No
    ``ipc_collect()``, no ``empty_cache()``."""
    size = 256 << 20
    warm_up(client, daemon.root, "fresh")
    torch.cuda.empty_cache()  # no cached block of earlier tests may stand in for the one held
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + size * 3 // 2) / total)
    try:
        for step in range(6):
            x = torch.full((size // 4,), float(step), device="cuda")  # OOM here if the last one is still held
            handle = client.snapshot({"x": x}, file_of(daemon.root, f"fresh{step}"))
            client.wait()
            del x
            client.commit(handle.tag).result(timeout=120)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.equal(checkpoint(file_of(daemon.root, "fresh5"))["x"], torch.full((size // 4,), 5.0))


def test_a_storage_whose_snapshot_was_skipped_is_freed_when_the_trainer_frees_it(daemon: DaemonProc) -> None:
    """A handle the daemon never opens (its snapshot skipped under ``on_busy="skip"``) has its slot released
    at once: freeing the tensor then gives its memory back, instead of parking it for the trainer's lifetime."""
    with Client(daemon.endpoint, timeout=120, on_busy="skip") as c:
        big = torch.ones(1 << 28, device="cuda")  # 1 GiB, still being copied when the next snapshot arrives
        c.snapshot({"big": big}, file_of(daemon.root, "busy"), tag="busy")
        x = torch.ones(1 << 24, device="cuda")  # 64 MiB
        skipped = c.snapshot({"x": x}, file_of(daemon.root, "skipped"), tag="skipped")
        c.wait()
        assert skipped.skipped, "the second tag was taken, not skipped: the test proves nothing"
        # read on either side of the free, not against a base from before the first snapshot: blocks freed
        # meanwhile (the probe's) must not count; freeing x may also collect others, never give back less than x
        before = torch.cuda.memory_allocated()
        del x
        held = torch.cuda.memory_allocated() - (before - (64 << 20))
        assert held <= 0, f"the skipped storage stayed parked in the trainer ({held} bytes)"
        c.commit("busy").result(timeout=120)
