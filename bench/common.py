"""Shared pieces of the benchmarks: a synthetic GPT state, a daemon to run against, medians.

Benchmarks print ratios measured in one run: the disk's speed drifts by ±30% over tens
of minutes here, so absolute figures from different runs do not compare.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import yaml

from datastates.client import daemon_status
from datastates.protocol.errors import DaemonUnavailable

BIN = os.path.dirname(sys.executable)


def gpt_state(layers: int = 24, dim: int = 1024, vocab: int = 50257, ctx: int = 1024, seed: int = 0) -> dict[str, Any]:
    """A GPT-2-shaped training state: fp32 parameters, AdamW exp_avg/exp_avg_sq/step, objects.

    With the defaults: 354 M parameters, 1.4 GB of weights, 4.3 GB in all, 1,168 tensors.
    """
    g = torch.Generator().manual_seed(seed)
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte.weight", (vocab, dim)), ("wpe.weight", (ctx, dim))]
    for i in range(layers):
        p = f"h.{i}."
        shapes += [
            (p + "ln_1.weight", (dim,)), (p + "ln_1.bias", (dim,)),
            (p + "attn.c_attn.weight", (dim, 3 * dim)), (p + "attn.c_attn.bias", (3 * dim,)),
            (p + "attn.c_proj.weight", (dim, dim)), (p + "attn.c_proj.bias", (dim,)),
            (p + "ln_2.weight", (dim,)), (p + "ln_2.bias", (dim,)),
            (p + "mlp.c_fc.weight", (dim, 4 * dim)), (p + "mlp.c_fc.bias", (4 * dim,)),
            (p + "mlp.c_proj.weight", (4 * dim, dim)), (p + "mlp.c_proj.bias", (dim,)),
        ]
    shapes += [("ln_f.weight", (dim,)), ("ln_f.bias", (dim,))]

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape).uniform_(-1, 1, generator=g)

    model = OrderedDict((name, rand(shape)) for name, shape in shapes)
    opt_state = {
        i: {"step": torch.tensor(float(100)), "exp_avg": rand(t.shape), "exp_avg_sq": rand(t.shape).abs_()}
        for i, t in enumerate(model.values())
    }
    return {
        "module": model,
        "optimizer": {
            "state": opt_state,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                              "params": list(range(len(model)))}],
        },
        "global_steps": 100,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state()},
        "args": {"layers": layers, "dim": dim, "vocab": vocab, "note": "synthetic"},
        "lr_schedule": np.linspace(0, 3e-4, 1000),
    }


def tensors_of(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_of(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in tensors_of(v)]
    return []


def state_bytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def print_medians(times: dict[str, list[float]], nbytes: int) -> dict[str, float]:
    """Each contender's median time and rate over its runs; the medians, for the ratios."""
    med = {n: median(t) for n, t in times.items()}
    width = max(len(n) for n in med) + 1
    print(f"\nmedians of {max(len(t) for t in times.values())} runs, {nbytes / 1e9:.2f} GB:")
    for name, seconds in med.items():
        print(f"  {name:<{width}} {seconds:8.3f} s  {nbytes / seconds / 1e9:6.2f} GB/s")
    print()
    return med


def drop_caches(*folders: str) -> None:
    """Evict every file under ``folders`` (on disk: never a tmpfs, see below) from the page cache.

    Per file (fsync, then ``POSIX_FADV_DONTNEED``), not the global ``/proc/sys/vm/drop_caches``:
    that one also deactivates every tmpfs page it cannot drop and marks it ``PG_reclaim``,
    which turns off fault-around for those pages from then on. A restore from the daemon's
    replicas in /dev/shm then takes one fault per 4 KiB page instead of one per 16 (measured
    here on 1.5 GB: 24,641 faults and 0.10 s before a global drop, 394,240 and 0.38 s
    after): a cost of the bench, which no trainer restarting after a crash meets.
    """
    for folder in folders:
        for d, _, files in os.walk(folder):
            for name in files:
                try:
                    fd = os.open(os.path.join(d, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def fsync_tree(folder: str) -> None:
    """fsync every file and folder under ``folder``: what a peer left in the page cache becomes durable."""
    for d, _, files in os.walk(folder):
        for name in [*files, "."]:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


@contextmanager
def datastatesd(root: str, **config: Any) -> Iterator[str]:
    """A datastatesd writing under ``root``; yields its endpoint and drains it on exit."""
    with daemon_process(root, [os.path.join(BIN, "datastatesd")], **config) as (_proc, endpoint):
        yield endpoint


@contextmanager
def daemon_process(root: str, command: list[str], env: dict[str, str] | None = None,
                   **config: Any) -> Iterator[tuple[subprocess.Popen, str]]:
    """``command --node-config FILE`` (datastatesd, or a wrapper of its main) writing under ``root``, once it
    answers; yields the process and its endpoint, and drains it on exit."""
    sockdir = tempfile.mkdtemp(prefix="ds-bench-")
    endpoint = f"ipc://{sockdir}/d/datastatesd.sock"
    cfg = {"endpoint": endpoint, "storage": {"roots": [root]}, "log_level": "warning", **config}
    path = os.path.join(sockdir, "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    proc = subprocess.Popen([*command, "--node-config", path], env=env)
    try:
        for _ in range(600):
            try:
                daemon_status(endpoint, timeout=0.5)
                break
            except DaemonUnavailable:
                if proc.poll() is not None:
                    raise RuntimeError(f"datastatesd exited with {proc.returncode}") from None
                time.sleep(0.5)  # not listening yet is said at once
        yield proc, endpoint
    finally:
        proc.terminate()
        proc.wait(120)
        shutil.rmtree(sockdir, ignore_errors=True)


def wait_pool_mapped(endpoint: str) -> None:
    """Wait until the daemon has mapped its whole pool and checked its object store tiers (their upload process
    started), as it does once when the node starts."""
    while True:
        status = daemon_status(endpoint)
        mem = status["daemon"]["host_memory"]
        if mem["chunks_allocated"] * mem["chunk_size"] >= mem["budget_bytes"] and status["tier_transfers"]["checked"]:
            return
        time.sleep(0.2)


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


RAW_PIECE = 64 << 20
"""The size of each O_DIRECT write of ``raw_write``."""


def raw_write(path: str, nbytes: int, threads: int) -> float:
    """``nbytes`` (rounded up to 4 KiB) written with O_DIRECT from an aligned buffer, ``RAW_PIECE`` writes on
    ``threads`` threads, then fsynced: the disk's own speed for the checkpoint's bytes."""
    buf = mmap.mmap(-1, RAW_PIECE)  # page-aligned
    buf.write(os.urandom(1 << 20) * (RAW_PIECE >> 20))
    size = (nbytes + 4095) // 4096 * 4096
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)

    def pieces(k: int) -> None:
        for off in range(k * RAW_PIECE, size, threads * RAW_PIECE):
            n = min(RAW_PIECE, size - off)
            done = 0
            while done < n:
                done += os.pwrite(fd, memoryview(buf)[done:n], off + done)

    try:
        workers = [threading.Thread(target=pieces, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


READER_ENV = "DS_BENCH_READER"
"""``threads,step_mib``: the reader's threads and read size in bench/load_once.py's process, where a bench changed
them in its own (bench/restore.py's --read-threads and --step-mib)."""


def in_fresh_process(kind: str, path: str, device: str = "cpu", cold: str | None = None) -> float:
    """Seconds of one fresh load of ``path`` (bench/load_once.py's KINDS) in a process of its own, as a resuming
    job loads; the page cache of ``cold`` dropped first."""
    if cold:
        drop_caches(cold)
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "load_once.py"),
                          kind, path, device], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"load_once.py {kind} {path} failed ({out.returncode}): {out.stderr[-2000:]}")
    return float(out.stdout.split()[-1])
