"""Restore time after a trainer crash: from the daemon's memory against storage, torch.load and DCP.

Why: most faults are a dead trainer on a healthy node, and the restart's first cost is
reading the checkpoint back. One GPT-shaped state is checkpointed once by each contender;
then, per run, with the checkpoints' files evicted from the page cache each time:

- memory: ``Client.restore`` served from the daemon's replica (/dev/shm), fresh and in place (``into=``);
- storage: ``datastates.load`` of the same committed file on disk, fresh and in place (``into=``);
- torch.load: of a ``torch.save`` file of the same state, and of datastates' own file (format 2 is a zip
  plain ``torch.load`` reads);
- DCP: ``torch.distributed.checkpoint.load`` into a preallocated state (in place).

Each fresh load (storage, torch.load, the raw read into a fresh buffer) runs in a process of its own,
as a resuming job's does (bench/load_once.py: in one process, glibc would hand torch.load the pages
the previous contender freed).

In-place restores write into a preallocated copy of the state, as a resuming job's model and
optimizer are; ``--fresh-only`` leaves them, the memory restores and DCP out (for a state too
large to hold several copies of). Then, run as root: the memory restores again, before and after
a global ``echo 3 > /proc/sys/vm/drop_caches``; and ``CheckpointManager.restore`` of a model +
AdamW state of the same size against ``datastates.load(path, into=...)`` alone.

Every restore touches each page of what it loaded. Two reference lines are measured in
the same runs: a raw O_DIRECT read of the datastates file with the reader's own threads
and piece size, into a fresh buffer and into one reused across runs. It prints medians
over ``--runs`` (contenders interleaved), the ratios against their targets, and where a storage
and a memory restore's time goes (``phases``: header, data read or mapped with its checksums,
rebuilding the state, touching it). ``--device cuda`` restores onto a GPU (bench/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import copy
import gc
import mmap
import os
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (READER_ENV, datastatesd, drop_caches, fsync_tree, gpt_state, in_fresh_process, median, print_medians,  # noqa: E402
                    state_bytes, tensors_of, timed)

import datastates  # noqa: E402
from datastates.client import Client  # noqa: E402
from datastates.client.reader import restore, stream  # noqa: E402
from datastates.client.reader.checks import open_file  # noqa: E402
from datastates.client.reader.stream import READ_PIECE, READ_THREADS  # noqa: E402
from datastates.protocol.tags import file_commits  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def touch(state: Any) -> None:
    for t in tensors_of(state):
        if t.numel():
            t.view(-1)[:: max(1, 4096 // t.element_size())].sum()
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a GPU restore's copies are done when it is


def on_device(state: Any, device: str) -> Any:
    """A copy of ``state`` with every tensor on ``device``: the model and optimizer a resuming job has built."""
    if isinstance(state, torch.Tensor):
        return state.to(device, copy=True)
    if isinstance(state, dict):
        return type(state)((k, on_device(v, device)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(on_device(v, device) for v in state)
    return copy.deepcopy(state)


def restore_and_touch(fn: Callable[[], Any]) -> Any:
    """What ``fn`` restored, each page touched; returned, so that freeing it happens outside the timing."""
    state = fn()
    touch(torch.frombuffer(state, dtype=torch.uint8) if isinstance(state, mmap.mmap) else state)
    return state


def raw_read(path: str, buf: mmap.mmap | None = None) -> mmap.mmap:
    """The whole file with O_DIRECT, the reader's threads of READ_PIECE reads, as it reads its data;
    into ``buf`` if given (warm pages), else a fresh buffer."""
    size = os.path.getsize(path) // 4096 * 4096  # all but the zip's central directory, an unaligned tail
    buf = buf if buf is not None else mmap.mmap(-1, size)
    view = memoryview(buf)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)

    def read(pos: int) -> None:
        stop = min(size, pos + READ_PIECE)
        while pos < stop:
            pos += os.preadv(fd, [view[pos:stop]], pos)

    try:
        with ThreadPoolExecutor(stream.READ_THREADS) as pool:
            list(pool.map(read, range(0, size, READ_PIECE)))
    finally:
        os.close(fd)
    return buf


def phases(path: str, cold: str | None = None) -> dict[str, float]:
    """Where a restore of ``path`` takes its time, phase by phase; the page cache of ``cold`` emptied first.

    "data and checksums" is the read from disk, each piece hashed as it lands, for a file in storage; mapping
    every page and hashing it for a replica in /dev/shm.
    """
    gc.collect()  # the previous run's state is freed here, not inside this one's timing
    if cold:
        drop_caches(cold)
    out: dict[str, float] = {}
    out["header"], file = timed(lambda: open_file(path, file_commits(path), views=True, zip_records=True))
    out["data and checksums"], region = timed(stream.Stream(file, None, True).read_region)
    rebuild = restore.fresh(file, region, True, None)
    out["rebuild"], state = timed(rebuild.entry, file.header.root)
    out["touch"], _ = timed(touch, state)
    return out


def every_run(times: dict[str, list[float]], ours: str, peer: str) -> str:
    wins = sum(a < b for a, b in zip(times[ours], times[peer]))
    return f"{ours} faster than {peer} in {wins} of {len(times[ours])} runs"


def global_drop(memory: dict[str, Callable[[], Any]], runs: int) -> None:
    """Each memory restore's median before and after a global drop of caches (root only)."""
    if not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        print("global drop of caches: skipped (needs root)")
        return
    before = {n: median([timed(restore_and_touch, fn)[0] for _ in range(runs)]) for n, fn in memory.items()}
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    after = {n: median([timed(restore_and_touch, fn)[0] for _ in range(runs)]) for n, fn in memory.items()}
    for n in memory:
        print(f"{n}: {before[n]:.3f} s before a global drop of caches, {after[n]:.3f} s after: "
              f"{after[n] / before[n]:.2f} x  (target <= 1.2)")


def manager_restore(root: str, endpoint: str, nbytes: int, runs: int) -> None:
    """CheckpointManager.restore of a model + AdamW state of about ``nbytes`` against the in-place load alone."""
    width = 2048
    layers = max(1, nbytes // 3 // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, width)).sum().backward()
    opt.step()
    folder = os.path.join(root, "manager")
    with Client(endpoint, timeout=600) as client:
        manager = datastates.CheckpointManager(client, folder, model=model, optimizer=opt)
        manager.save(1).result()
        path = manager.path(manager.tag(1))
        fsync_tree(folder)
        into = {"step": None, "rng": None, "model": model.state_dict(), "optimizer": opt.state_dict()}
        contenders = {"CheckpointManager.restore": manager.restore,
                      "datastates.load(into=)": lambda: datastates.load(path, into=into)}
        times: dict[str, list[float]] = {n: [] for n in contenders}
        for _ in range(runs):
            for name, fn in contenders.items():
                drop_caches(folder)
                times[name].append(timed(fn)[0])
        manager.close()
    med = print_medians(times, state_bytes(into))
    print(f"CheckpointManager.restore / in-place load alone: "
          f"{med['CheckpointManager.restore'] / med['datastates.load(into=)']:.3f}  (target <= 1.1)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fresh-only", action="store_true", help="no in-place, memory or DCP restores")
    parser.add_argument("--read-threads", type=int, default=READ_THREADS,
                        help=f"the reader's threads (default {READ_THREADS}), to see how many the disk rewards")
    parser.add_argument("--step-mib", type=int, default=stream.STEP >> 20,
                        help=f"the reader's read size, MiB (default {stream.STEP >> 20})")
    parser.add_argument("--device", default="cpu", help="where restored tensors go: cpu, or cuda (bench/gpu_check.sh)")
    parser.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir)")
    args = parser.parse_args()
    stream.READ_THREADS, stream.STEP = args.read_threads, args.step_mib << 20
    os.environ[READER_ENV] = f"{args.read_threads},{args.step_mib}"  # for the fresh loads' processes too
    root = args.root or tempfile.mkdtemp(prefix="ds-bench-restore-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    state = gpt_state(layers=args.layers, dim=args.dim)
    nbytes = state_bytes(state)
    print(f"state: {nbytes / 1e9:.2f} GB in {len(tensors_of(state))} tensors; {args.runs} runs; root {root}")
    budget = "64MiB" if args.fresh_only else f"{nbytes * 2 // (1 << 20) + 64}MiB"
    try:
        with datastatesd(root, host_memory="1GiB", memory_restore_budget=budget) as ep:
            with Client(ep, timeout=600) as client:
                ours = os.path.join(root, "step1", "rank0.pt")
                client.snapshot(state, ours)
                client.wait()
                client.commit("step1").result()
                os.makedirs(os.path.join(root, "ts"))
                torch.save(state, os.path.join(root, "ts", "rank0.pt"))
                memory: dict[str, Callable[[], Any]] = {}
                if not args.fresh_only:
                    dcp.save({"state": state}, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
                    template = {"state": on_device(state, args.device)}  # DCP loads in place, into preallocated tensors
                    into_storage, into_memory = on_device(state, args.device), on_device(state, args.device)

                    def dcp_load() -> Any:
                        dcp.load(template, checkpoint_id=os.path.join(root, "dcp"), no_dist=True)
                        return template

                    def from_memory(into: Any = None) -> Any:
                        restored = client.restore(root, "rank0.pt", into=into,
                                                  map_location=None if into is not None else args.device)
                        assert restored is not None and restored.source == "memory", restored
                        return restored.state

                    memory = {"memory": from_memory, "memory, in place": lambda: from_memory(into_memory)}
                fsync_tree(root)
                reused = raw_read(ours)  # its pages warm for "raw, reused"
                ts = os.path.join(root, "ts", "rank0.pt")

                def here(fn: Callable[[], Any]) -> Callable[[], float]:
                    """An in-place or memory restore, timed in this process: it reuses memory it holds already."""
                    def run() -> float:
                        gc.collect()  # the previous contender's state is freed here, not inside the next timing
                        drop_caches(root)
                        seconds, restored = timed(restore_and_touch, fn)
                        del restored  # freed outside the timing: unmapping 1.5 GB is no part of a restore
                        return seconds
                    return run

                def fresh(kind: str, path: str) -> Callable[[], float]:
                    """A fresh load, in a process of its own as a resuming job's (bench/load_once.py says why)."""
                    return lambda: in_fresh_process(kind, path, args.device, cold=root)

                contenders: dict[str, Callable[[], float]] = {
                    "raw O_DIRECT, fresh buffer": fresh("raw", ours),
                    "raw O_DIRECT, reused buffer": here(lambda: raw_read(ours, reused)),
                    **{name: here(fn) for name, fn in memory.items()},
                    "storage": fresh("datastates.load", ours),
                    **({} if args.fresh_only else {"storage, in place": here(lambda: datastates.load(ours, into=into_storage)),
                                                   "dcp": here(dcp_load)}),
                    "torch.load": fresh("torch.load", ts),
                    "torch.load of datastates' file": fresh("torch.load", ours),
                }
                times: dict[str, list[float]] = {n: [] for n in contenders}
                for r in range(args.runs):
                    for name, run in contenders.items():
                        times[name].append(run())
                    print(f"run {r + 1}/{args.runs}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()),
                          flush=True)
                profile = {"storage": [phases(ours, root) for _ in range(args.runs)]}
                if memory:
                    replica = client.status()["replicas"]["replicas"][0]["file"]
                    profile["memory"] = [phases(replica) for _ in range(args.runs)]
                med = print_medians(times, nbytes)
                report(times, med, profile)
                if memory and args.device == "cpu":
                    global_drop(memory, args.runs)
                    manager_restore(root, ep, nbytes, args.runs)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def report(times: dict[str, list[float]], med: dict[str, float], profile: dict[str, list[dict[str, float]]]) -> None:
    """The ratios against their targets, and whether ours won every run."""
    reused, fresh = med["raw O_DIRECT, reused buffer"], med["raw O_DIRECT, fresh buffer"]
    print(f"storage restore speed / raw O_DIRECT read into a fresh buffer: {fresh / med['storage']:.3f}")
    for peer in ("torch.load", "torch.load of datastates' file"):
        print(f"restore time: storage / {peer}: {med['storage'] / med[peer]:.3f}  (target < 1; "
              f"{every_run(times, 'storage', peer)})")
    if "storage, in place" in med:
        print(f"in-place storage restore speed / raw O_DIRECT read into a reused buffer: "
              f"{reused / med['storage, in place']:.3f}  (target >= 0.85)")
        print(f"restore time: storage, in place / dcp: {med['storage, in place'] / med['dcp']:.3f}  "
              f"(target < 1; {every_run(times, 'storage, in place', 'dcp')})")
        for kind in ("memory", "memory, in place"):
            print(f"restore time: {kind} / storage, in place: {med[kind] / med['storage, in place']:.3f}  "
                  "(target <= 0.25)")
    for kind, runs in profile.items():
        print(f"{kind} restore by phase (medians, s): " + ", ".join(
            f"{k} {median([p[k] for p in runs]):.3f}" for k in runs[0]))


if __name__ == "__main__":
    sys.exit(main())
