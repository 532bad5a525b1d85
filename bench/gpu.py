"""The GPU path: datastates against a plain pinned copy and DCP ``async_save`` with pinned staging.

Why: on a GPU the checkpoint's first cost is the device-to-host copy, and the question is
whether copying through CUDA IPC on the daemon's own streams reaches the link's speed
without holding the trainer. For one GPT-shaped state on the GPU it measures, per run:

- peak: ``tensor.copy_(non_blocking=True)`` of every tensor into one pinned host buffer,
  in the trainer, from an idle GPU to a final synchronize: the device-to-host limit here;
- datastates: ``snapshot()`` (blocking), until ``wait()`` returns (the device-to-host copy
  into the daemon's pinned pool is done: GB/s), and until ``commit()`` is durable;
- torch.save: the whole save, fsynced, in the trainer (everything blocks);
- DCP: ``async_save`` in thread mode with a ``DefaultStager`` staging asynchronously into
  pinned memory (blocking), until staging completes (GB/s), and until the upload is done;

and, training a small MLP on the GPU with a checkpoint every ``--every`` steps, the mean
step time of no checkpointing, datastates and DCP over a window of steps timed with one
final ``torch.cuda.synchronize()``: a sync around each step would drain the GPU queue
before every ``snapshot()`` and hide what ordering the copy after it costs. The window
ends once the last checkpoint no longer reads the live tensors, as the next optimizer
step would wait for that. It prints the daemon's copy threads, what each GB/s figure
includes, medians over ``--runs`` (contenders interleaved within each run) and the
ratios; only the ratios compare across runs. ``--endpoint`` measures a daemon already
running, ``--node-config`` starts one with a node config's settings. Without a CUDA
device it says so and exits 0.

``--copy-threads N [N ...]`` measures the device-to-host copy alone, with a daemon of each
number of copy threads: the pinned peak, a pageable ``copy_`` (what a synchronous copy
through the driver's bounce buffer reaches), and datastates from ``snapshot()`` to
``wait()`` and as its snapshot's ``copy_bps``. It exits 1 unless, with some thread count,
the daemon's ``copy_bps`` reaches ``COPY_FLOOR`` of the pinned peak measured in the same
run. Beating the pageable copy is not enough: an unpinned pool copied by many threads can.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import yaml

from datastates.client import daemon_status
from datastates.daemon.config import default_copy_threads

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, fsync_tree, gpt_state, median, state_bytes, tensors_of, wait_pool_mapped  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is what we want

Timing = tuple[float, float, float]
"""(blocking, safe, durable) seconds of one checkpoint."""


def to_cuda(state: Any) -> Any:
    """Floating-point tensors onto the GPU, as a trainer holds them; RNG states and objects stay."""
    if isinstance(state, torch.Tensor):
        return state.cuda() if state.is_floating_point() else state
    if isinstance(state, dict):
        return type(state)((k, to_cuda(v)) for k, v in state.items())
    if isinstance(state, list):
        return [to_cuda(v) for v in state]
    return state


def peak_copy(state: Any) -> Callable[[], float]:
    """Seconds to copy every GPU tensor into one reused pinned buffer: the device-to-host limit."""
    gpu = [t for t in tensors_of(state) if t.is_cuda]
    host = torch.empty(sum(t.nbytes for t in gpu), dtype=torch.uint8, pin_memory=True)
    views, cursor = [], 0
    for t in gpu:
        views.append(host[cursor:cursor + t.nbytes].view(t.dtype).view(t.shape))
        cursor += t.nbytes

    def run() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(views, gpu):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return run


def pageable_copy(state: Any) -> Callable[[], float]:
    """Seconds to copy every GPU tensor into pageable host tensors: synchronous, through the driver's staging."""
    gpu = [t for t in tensors_of(state) if t.is_cuda]
    host = [torch.empty(t.shape, dtype=t.dtype) for t in gpu]

    def run() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for dst, src in zip(host, gpu):
            dst.copy_(src)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return run


def datastates_save(client: Any, state: Any, root: str) -> Callable[[int], Timing]:
    def save(i: int) -> Timing:
        tag = f"ds{i}"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        client.snapshot(state, os.path.join(root, tag, "model_states.pt"), tag=tag)
        blocking = time.perf_counter() - t0
        client.wait()
        safe = time.perf_counter() - t0
        client.commit(tag).result()
        return blocking, safe, time.perf_counter() - t0

    return save


def torch_save(state: Any, root: str) -> Callable[[int], Timing]:
    """torch.save in the trainer, fsynced: every phase blocks, so blocking = safe = durable."""
    def save(i: int) -> Timing:
        folder = os.path.join(root, f"ts{i}")
        os.makedirs(folder, exist_ok=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.save(state, os.path.join(folder, "model_states.pt"))
        fsync_tree(folder)
        elapsed = time.perf_counter() - t0
        return elapsed, elapsed, elapsed

    return save


class PinnedStager:
    """DCP's DefaultStager with pinned buffers, reused across saves as DCP advises.

    Some torch versions (2.11 on the GPU machine) close a caller's stager once its
    ``async_save`` ends, which empties its copy table: the next save through it fails with
    ``KeyError: <class 'type'>``. Then each save gets a new stager, which pins its buffers
    again, as it would in a trainer on that torch; ``made`` counts them for the report.
    """

    def __init__(self) -> None:
        self.made = 0
        self._stager: Any = None

    def get(self) -> Any:
        if self._stager is None or self._closed():
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                        use_async_staging=True, use_non_blocking_copy=True))
            self.made += 1
        return self._stager

    def _closed(self) -> bool:
        inner = getattr(self._stager, "_state_dict_stager", None)  # private: DCP has no public "closed" flag
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def close(self) -> None:
        if self._stager is not None:
            self._stager.close()


def dcp_async(state: Any, folder: str, stager: PinnedStager) -> tuple[float, Future | None, Future]:
    """Start one ``async_save``: (blocking seconds, staging future or None, upload future)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

    t0 = time.perf_counter()
    resp = dcp.async_save(state, checkpoint_id=folder, async_checkpointer_type=AsyncCheckpointerType.THREAD,
                          async_stager=stager.get(), no_dist=True)
    blocking = time.perf_counter() - t0
    if isinstance(resp, AsyncSaveResponse):
        return blocking, resp.staging_completion, resp.upload_completion
    return blocking, None, resp


def dcp_save(state: Any, root: str, stager: PinnedStager) -> Callable[[int], Timing]:
    def save(i: int) -> Timing:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        blocking, staging, upload = dcp_async(state, os.path.join(root, f"dcp{i}"), stager)
        if staging is not None:
            staging.result()
        safe = time.perf_counter() - t0
        upload.result()
        return blocking, safe, time.perf_counter() - t0

    return save


# -- the daemon measured -------------------------------------------------------------------


def add_daemon_args(parser: argparse.ArgumentParser) -> None:
    """``--endpoint`` and ``--node-config``: which daemon a GPU bench measures."""
    parser.add_argument("--endpoint", help="measure the datastatesd running there (its roots must hold --root) "
                                           "instead of starting one")
    parser.add_argument("--node-config", help="start the daemon with this node config's settings over the bench's "
                                              "(its endpoint and storage stay the bench's)")


@dataclass(frozen=True)
class BenchDaemon:
    endpoint: str
    copy_threads: str
    """As the bench configured it, or as a running daemon's status reports it."""


@contextmanager
def bench_daemon(args: argparse.Namespace, root: str, **settings: Any) -> Iterator[BenchDaemon]:
    """The daemon to measure, its pool mapped: the one at ``--endpoint``, or a new one with ``settings`` under
    ``--node-config``'s, its ``copy_threads`` set explicitly so that the report can say it."""
    if args.endpoint:
        wait_pool_mapped(args.endpoint)
        reported = daemon_status(args.endpoint)["daemon"].get("copy_threads", "not in its status")
        yield BenchDaemon(args.endpoint, str(reported))
        return
    settings = {"copy_threads": default_copy_threads(), **settings, **node_settings(args.node_config)}
    with datastatesd(root, **settings) as endpoint:
        wait_pool_mapped(endpoint)
        yield BenchDaemon(endpoint, str(settings["copy_threads"]))


def node_settings(path: str | None) -> dict[str, Any]:
    """A node config's settings but its endpoint and storage, which the bench sets; none without ``path``."""
    if path is None:
        return {}
    with open(path) as f:
        return {k: v for k, v in (yaml.safe_load(f) or {}).items() if k not in ("endpoint", "storage")}


def pool_pinning(endpoint: str) -> str:
    """How much of the daemon's pool is page-locked: into the rest, device-to-host copies are synchronous and slower."""
    pool = daemon_status(endpoint)["daemon"]["host_memory"]
    failed = f", pin_error: {pool['pin_error']}" if pool["pin_error"] else ""
    return f"{pool['chunks_pinned']} of {pool['chunks_allocated']} chunks pinned{failed}"


# -- step-time overhead --------------------------------------------------------------------


def mlp(dim: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(dim, dim), torch.nn.GELU())]).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


class Checkpoints(ABC):
    """One way of checkpointing from the training loop; the timed window treats every way alike."""

    @abstractmethod
    def save(self, state: Any, tag: str) -> None:
        """Start a checkpoint of ``state``; returns as soon as the trainer may go on."""

    def fence(self) -> None:
        """Block until the last checkpoint no longer reads the live tensors: what the next optimizer step waits for."""

    def close(self) -> None:
        """Block until every checkpoint is durable, and let go of what was held."""


class NoCheckpoints(Checkpoints):
    def save(self, state: Any, tag: str) -> None:
        pass


class DatastatesCheckpoints(Checkpoints):
    """``snapshot()`` and ``commit()``; ``protect()`` makes each optimizer step wait for the copy."""

    def __init__(self, endpoint: str, root: str, opt: torch.optim.Optimizer) -> None:
        from datastates.client import Client

        self.root = root
        self.client = Client(endpoint, timeout=600)
        self.client.protect(opt)
        self.commits: list[Future] = []

    def save(self, state: Any, tag: str) -> None:
        self.client.snapshot(state, os.path.join(self.root, tag, "model_states.pt"), tag=tag)
        self.commits.append(self.client.commit(tag))

    def fence(self) -> None:
        self.client.wait()

    def close(self) -> None:
        for fut in self.commits:
            fut.result()
        self.client.close()


class DcpCheckpoints(Checkpoints):
    """``async_save`` with a reused pinned stager; a step pre-hook waits for staging, which reads the live tensors."""

    def __init__(self, root: str, opt: torch.optim.Optimizer) -> None:
        self.root = root
        self.stager = PinnedStager()
        self.staging: Future | None = None
        self.upload: Future | None = None
        opt.register_step_pre_hook(lambda *_: self.fence())

    def save(self, state: Any, tag: str) -> None:
        if self.upload is not None:
            self.upload.result()  # the reused stager overwrites its buffers
        _, self.staging, self.upload = dcp_async(state, os.path.join(self.root, tag), self.stager)

    def fence(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def close(self) -> None:
        if self.upload is not None:
            self.upload.result()
        self.stager.close()


CHECKPOINTS: dict[str, Callable[[str, str, torch.optim.Optimizer], Checkpoints]] = {
    "none": lambda endpoint, root, opt: NoCheckpoints(),
    "datastates": DatastatesCheckpoints,
    "dcp": lambda endpoint, root, opt: DcpCheckpoints(root, opt),
}


def train(mode: str, run: int, args: argparse.Namespace, root: str, endpoint: str) -> float:
    """Mean step time over steps ``warmup + 1`` to ``steps``, checkpointing every ``args.every`` steps the ``mode``
    way into ``root``: one window, synchronized once at its end, ended once the last checkpoint is fenced."""
    model, opt = mlp(args.mlp_dim, args.mlp_layers)
    x = torch.randn(args.batch, args.mlp_dim, device="cuda")
    ckpt = CHECKPOINTS[mode](endpoint, root, opt)

    def steps(numbers: range) -> None:
        for step in numbers:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % args.every == 0:
                ckpt.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, f"r{run}-{mode}{step}")

    steps(range(1, args.warmup + 1))
    ckpt.fence()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps(range(args.warmup + 1, args.steps + 1))
    ckpt.fence()
    torch.cuda.synchronize()
    window = time.perf_counter() - t0
    ckpt.close()
    return window / (args.steps - args.warmup)


# -- the run -------------------------------------------------------------------------------


def clear(root: str) -> None:
    """Remove the checkpoints under ``root``: at several GB each, the runs would fill the disk."""
    for name in os.listdir(root):
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def copy_bps(endpoint: str, path: str) -> float:
    """The daemon's ``copy_bps`` of its latest snapshot of ``path``."""
    return [j for j in daemon_status(endpoint)["snapshots"] if j["path"] == path][-1]["copy_bps"]


COPY_FLOOR = 0.5
"""The least ``copy_bps`` / pinned peak ``--copy-threads`` passes with: copies run asynchronously into the pinned
pool, not synchronously through a bounce buffer. The one GPU run so far (2026-12-04) measured 0.12."""


def copy_only(args: argparse.Namespace, state: Any, nbytes: int, pool: int, under: str) -> int:
    """``--copy-threads``: the device-to-host copy alone, per number of copy threads (see the module's docstring)."""
    from datastates.client import Client

    peak, pageable = peak_copy(state), pageable_copy(state)
    peaks = [peak() for _ in range(args.runs)]
    pageables = [pageable() for _ in range(args.runs)]
    rows = []
    for threads in args.copy_threads:
        root = tempfile.mkdtemp(prefix=f"ds-copy{threads}-", dir=under)
        try:
            with bench_daemon(args, root, host_memory=f"{pool}MiB", chunk_size="64MiB", copy_threads=threads,
                              memory_restore="none") as daemon, Client(daemon.endpoint, timeout=600) as client:
                save = datastates_save(client, state, root)
                save(-1)  # sharing and opening
                clear(root)
                safe, bps = [], []
                for r in range(args.runs):
                    safe.append(save(r)[1])
                    bps.append(copy_bps(daemon.endpoint, os.path.join(root, f"ds{r}", "model_states.pt")))
                    clear(root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        rows.append((threads, nbytes / median(safe) / 1e9, median(bps) / 1e9))
    peak_gbps, pageable_gbps = nbytes / median(peaks) / 1e9, nbytes / median(pageables) / 1e9
    print(f"\ncopy only: state {nbytes / 1e9:.2f} GB, medians of {args.runs} runs; peak pinned copy_ "
          f"{peak_gbps:.1f} GB/s, pageable copy_ {pageable_gbps:.1f} GB/s")
    print(f"{'copy_threads':>12} {'snapshot->wait GB/s':>20} {'copy_bps GB/s':>14} {'/ peak':>7} "
          f"{'copy_bps / peak':>16}")
    for threads, safe_gbps, job_gbps in rows:
        print(f"{threads:>12} {safe_gbps:>20.1f} {job_gbps:>14.1f} {safe_gbps / peak_gbps:>7.2f} "
              f"{job_gbps / peak_gbps:>16.2f}")
    ratio = max(r[2] for r in rows) / peak_gbps
    print(f"copy_bps / pinned peak copy_: {ratio:.2f} (best over copy_threads; at least {COPY_FLOOR} passes): "
          f"{'pass' if ratio >= COPY_FLOOR else 'FAIL'}")
    return 0 if ratio >= COPY_FLOOR else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="steps before the timed window")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--mlp-dim", type=int, default=2048)
    parser.add_argument("--mlp-layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir)")
    parser.add_argument("--copy-threads", type=int, nargs="+", default=None,
                        help="measure the device-to-host copy alone, with a daemon of each of these copy_threads")
    add_daemon_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device here (torch.cuda.is_available() is False); nothing measured")
        return 0
    if args.copy_threads and args.endpoint:
        parser.error("--copy-threads starts its own daemons: it takes no --endpoint")

    from datastates.client import Client

    root = args.root or tempfile.mkdtemp(prefix="ds-bench-gpu-")
    os.makedirs(root, exist_ok=True)
    state = to_cuda(gpt_state(layers=args.layers, dim=args.dim))
    nbytes = state_bytes(state)
    pool = -(-nbytes * 5 // 4 // (64 << 20)) * 64  # MiB: the whole state fits, so wait() measures the copy alone
    print(f"state: {nbytes / 1e9:.2f} GB in {len(tensors_of(state))} tensors on {torch.cuda.get_device_name()}; "
          f"{args.runs} runs; root {root}")
    if args.copy_threads:
        try:
            return copy_only(args, state, nbytes, pool, root)
        finally:
            if args.root is None:
                shutil.rmtree(root, ignore_errors=True)
    samples: dict[str, list[Timing]] = {"datastates": [], "dcp pinned": [], "torch.save": []}
    peaks: list[float] = []
    step_s: dict[str, list[float]] = {mode: [] for mode in CHECKPOINTS}
    try:
        with bench_daemon(args, root, host_memory=f"{pool}MiB", chunk_size="64MiB") as daemon:
            peak = peak_copy(state)
            stager = PinnedStager()
            with Client(daemon.endpoint, timeout=600) as client:
                contenders = {"datastates": datastates_save(client, state, root), "dcp pinned": dcp_save(state, root, stager),
                              "torch.save": torch_save(state, root)}
                for save in contenders.values():  # first calls: sharing, pinning, allocations
                    save(-1)
                    clear(root)
                print(f"daemon: copy_threads {daemon.copy_threads}, pool {pool_pinning(daemon.endpoint)}; "
                      f"datastates GPU capture {client.gpu_capture_paths}", flush=True)
                for r in range(args.runs):
                    peaks.append(peak())
                    for name, save in contenders.items():
                        samples[name].append(save(r))
                        clear(root)
                    for mode in step_s:
                        step_s[mode].append(train(mode, r, args, root, daemon.endpoint))
                        clear(root)
                    print(f"run {r + 1}/{args.runs}: peak {nbytes / peaks[-1] / 1e9:.1f} GB/s, "
                          + ", ".join(f"{n} safe {s[-1][1]:.3f} s" for n, s in samples.items())
                          + ", step " + ", ".join(f"{m} {v[-1] * 1e3:.1f} ms" for m, v in step_s.items()), flush=True)
            print(f"dcp pinned: {stager.made} stager(s) made for {args.runs + 1} saves"
                  + (" (this torch closes a caller's stager after each async_save)" if stager.made > 1 else ""))
            stager.close()
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    report(nbytes, median(peaks), samples, {m: median(v) for m, v in step_s.items()}, args.runs, daemon.copy_threads)
    return 0


GBPS = {
    "peak copy_": "every GPU tensor copy_(non_blocking) into one pinned buffer, in the trainer, idle GPU to a final sync",
    "datastates": "device->host copy into the daemon's pinned pool, measured from snapshot() to wait() return",
    "dcp pinned": "device->host copy into DCP's pinned staging buffers, from async_save() to its staging future",
    "torch.save": "the whole save in the trainer: device->host, pickling and an fsynced write",
}
"""What each GB/s figure includes: the state's bytes over the seconds of this span."""


def report(nbytes: int, peak: float, samples: dict[str, list[Timing]], steps: dict[str, float], runs: int,
           copy_threads: str) -> None:
    print(f"\nmedians of {runs} runs, state {nbytes / 1e9:.2f} GB, daemon copy_threads {copy_threads}")
    print(f"{'contender':<12} {'blocking s':>11} {'safe s':>8} {'GB/s':>6} {'durable s':>10}")
    print(f"{'peak copy_':<12} {'':>11} {peak:>8.3f} {nbytes / peak / 1e9:>6.1f}")
    med = {n: [median([s[k] for s in xs]) for k in range(3)] for n, xs in samples.items()}
    for name, (blocking, safe, durable) in med.items():
        print(f"{name:<12} {blocking:>11.4f} {safe:>8.3f} {nbytes / safe / 1e9:>6.1f} {durable:>10.3f}")
    print("GB/s: the state's bytes over")
    for name, span in GBPS.items():
        print(f"  {name:<12} {span}")
    print("\nmean step time over a window synchronized once: " + ", ".join(f"{m} {s * 1e3:.2f} ms" for m, s in steps.items()))
    ds, dcp, ts = med["datastates"], med["dcp pinned"], med["torch.save"]
    ratios = {
        "D2H throughput: datastates / peak pinned copy_ (target >= 0.85)": peak / ds[1],
        "D2H throughput: dcp pinned / peak pinned copy_": peak / dcp[1],
        "D2H throughput: datastates / dcp pinned": dcp[1] / ds[1],
        "blocking per checkpoint: datastates / dcp pinned (target <= 0.1)": ds[0] / dcp[0],
        "blocking per checkpoint: datastates / torch.save": ds[0] / ts[0],
        "durable per checkpoint: datastates / torch.save": ds[2] / ts[2],
        "step-time overhead vs none: datastates": steps["datastates"] / steps["none"] - 1,
        "step-time overhead vs none: dcp pinned": steps["dcp"] / steps["none"] - 1,
    }
    print()
    for k, v in ratios.items():
        print(f"{k:<66} {v:8.4f}")


if __name__ == "__main__":
    sys.exit(main())
