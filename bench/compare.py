"""datastates against torch.save, DCP and the raw disk, on one GPT-shaped state, in one run.

For each contender and run it measures:
- blocking: how long the training thread is held by the call that starts the checkpoint;
- safe: until the trainer may change the tensors in place again (the fence);
- durable: until the data is fsynced and committed;
- restore: loading the checkpoint back with a cold page cache, every byte read, in a process of its own as a
  resuming job does (bench/load_once.py; the raw reads in this one).
It prints medians over ``--runs`` rounds (contenders interleaved within each round, so
disk drift hits all alike) and the ratios datastates / peer, and writes a JSON and a PNG.
Run it as root on an otherwise idle machine: it drops the page cache before restores.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(__file__))
from common import (datastatesd, drop_caches, fsync_tree, gpt_state, in_fresh_process, median, state_bytes,  # noqa: E402
                    tensors_of, wait_pool_mapped)

import datastates  # noqa: E402
from datastates.client import Client  # noqa: E402

RAW_PIECE = 64 << 20


@dataclass
class Sample:
    blocking: float
    safe: float
    durable: float
    restore: float


@dataclass
class Contender:
    name: str
    save: Callable[[str], tuple[float, float, float]]
    """Checkpoint into a fresh folder; returns (blocking, safe, durable) seconds."""
    restore: Callable[[str], float]
    samples: list[Sample] = field(default_factory=list)


# -- contenders ---------------------------------------------------------------------------


def torch_save(state: Any) -> Contender:
    def save(folder: str) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        with open(os.path.join(folder, "model.pt"), "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        dt = time.perf_counter() - t0
        return dt, dt, dt

    return Contender("torch.save", save, lambda folder: in_fresh_process("torch.load", os.path.join(folder, "model.pt")))


def _dcp_restore(folder: str) -> float:
    return in_fresh_process("dcp.load", folder)


def dcp_save(state: Any, threads: int) -> Contender:
    def save(folder: str) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=threads))
        dt = time.perf_counter() - t0
        return dt, dt, dt

    return Contender(f"dcp.save ({threads} threads)", save, _dcp_restore)


def dcp_async(state: Any, mode: str, stager: Any | None, label: str) -> Contender:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    kind = AsyncCheckpointerType.PROCESS if mode == "process" else AsyncCheckpointerType.THREAD

    def save(folder: str) -> tuple[float, float, float]:
        t0 = time.perf_counter()
        out = dcp.async_save(
            state, storage_writer=dcp.FileSystemWriter(folder, thread_count=2), async_checkpointer_type=kind,
            async_stager=stager,
        )
        blocking = time.perf_counter() - t0
        staged, upload = (out.staging_completion, out.upload_completion) if hasattr(out, "upload_completion") else (None, out)
        if staged is not None:
            staged.result()
        safe = time.perf_counter() - t0
        upload.result()
        return blocking, safe, time.perf_counter() - t0

    return Contender(f"dcp.async_save {mode}, {label}", save, _dcp_restore)


def dcp_datastates(state: Any, endpoint: str) -> Contender:
    """``dcp.async_save`` through ``DatastatesStorageWriter`` (one process, ``no_dist``); loaded back with
    ``DatastatesStorageReader``."""
    from datastates.integrations.dcp import DatastatesStorageReader, DatastatesStorageWriter

    client = Client(endpoint, timeout=300)
    counter = iter(range(1_000_000))

    def save(folder: str) -> tuple[float, float, float]:
        checkpoint_id = os.path.join(folder, f"step{next(counter)}")  # the folder's name is the tag
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=checkpoint_id, storage_writer=DatastatesStorageWriter(client),
                             no_dist=True)
        blocking = time.perf_counter() - t0
        client.wait()
        safe = time.perf_counter() - t0
        fut.result()
        return blocking, safe, time.perf_counter() - t0

    def restore(folder: str) -> float:
        return in_fresh_process("dcp.load via datastates", os.path.join(folder, datastates.latest(folder)))

    return Contender("dcp.async_save via datastates", save, restore)


def raw_disk(nbytes: int, fresh: bool) -> Contender:
    """O_DIRECT writes and reads of the same byte count, 2 threads: the physical limit.

    With ``fresh`` the reads land in newly mapped memory, as any restore's do: on a
    virtual machine that reclaims free memory, touching new pages is what bounds a restore.
    """
    buf = mmap.mmap(-1, RAW_PIECE)
    buf.write(os.urandom(1 << 20) * (RAW_PIECE >> 20))
    size = (nbytes + 4095) // 4096 * 4096
    dest: list[mmap.mmap] = []

    def pieces(fd: int, op: Callable[..., int], start: int) -> None:
        for off in range(start * RAW_PIECE, size, 2 * RAW_PIECE):
            n = min(RAW_PIECE, size - off)
            target = memoryview(dest[0])[off:off + n] if dest and op is os.preadv else memoryview(buf)[:n]
            op(fd, [target], off)

    def run(path: str, flags: int, op: Callable[..., int]) -> float:
        t0 = time.perf_counter()
        fd = os.open(path, flags | os.O_DIRECT, 0o644)
        threads = [threading.Thread(target=pieces, args=(fd, op, k)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if flags & os.O_WRONLY:
            os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t0

    def save(folder: str) -> tuple[float, float, float]:
        dt = run(os.path.join(folder, "raw.bin"), os.O_WRONLY | os.O_CREAT, os.pwritev)
        return dt, dt, dt

    def restore(folder: str) -> float:
        dest.clear()
        if fresh:
            dest.append(mmap.mmap(-1, size))  # mapped lazily: the reads below fault its pages in
        return run(os.path.join(folder, "raw.bin"), os.O_RDONLY, os.preadv)

    return Contender(f"raw O_DIRECT ({'fresh' if fresh else 'reused'} buffer)", save, restore)


def datastates_contender(state: Any, endpoint: str, load: str = "datastates.load") -> Contender:
    """Snapshots through the daemon; loaded back by ``load`` (bench/load_once.py's KINDS): ``datastates.load``, or
    plain ``torch.load`` of the same file (a zip it reads), the peer a user could pick for it."""
    client = Client(endpoint, timeout=300)
    counter = iter(range(1_000_000))

    def save(folder: str) -> tuple[float, float, float]:
        tag = f"step{next(counter)}"
        t0 = time.perf_counter()
        client.snapshot(state, os.path.join(folder, tag, "model_states.pt"), tag=tag)
        blocking = time.perf_counter() - t0
        client.wait()
        safe = time.perf_counter() - t0
        client.commit(tag).result()
        return blocking, safe, time.perf_counter() - t0

    def restore(folder: str) -> float:
        return in_fresh_process(load, os.path.join(folder, datastates.latest(folder), "model_states.pt"))

    return Contender("datastates" if load == "datastates.load" else f"{load} of the datastates file", save, restore)


# -- the run -------------------------------------------------------------------------------


def run_round(contenders: list[Contender], root: str) -> None:
    for c in contenders:
        folder = os.path.join(root, c.name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        blocking, safe, durable = c.save(folder)
        fsync_tree(folder)
        drop_caches(folder)
        restore = c.restore(folder)
        c.samples.append(Sample(blocking, safe, durable, restore))
        print(f"  {c.name:<44} blocking {blocking:8.4f} s  safe {safe:7.3f} s  durable {durable:7.3f} s  restore {restore:7.3f} s", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()


def summarize(contenders: list[Contender], nbytes: int) -> dict[str, Any]:
    rows = {}
    for c in contenders:
        med = {k: median([getattr(s, k) for s in c.samples]) for k in ("blocking", "safe", "durable", "restore")}
        med["durable_gbps"] = nbytes / med["durable"] / 1e9
        med["restore_gbps"] = nbytes / med["restore"] / 1e9
        rows[c.name] = med
    return rows


def print_table(rows: dict[str, Any], nbytes: int, runs: int) -> None:
    print(f"\nmedians of {runs} runs, state {nbytes / 1e9:.2f} GB")
    print(f"{'contender':<44} {'blocking s':>11} {'safe s':>8} {'durable s':>10} {'GB/s':>6} {'restore s':>10} {'GB/s':>6}")
    for name, r in rows.items():
        print(f"{name:<44} {r['blocking']:>11.4f} {r['safe']:>8.3f} {r['durable']:>10.3f} {r['durable_gbps']:>6.2f} "
              f"{r['restore']:>10.3f} {r['restore_gbps']:>6.2f}")


def ratios(rows: dict[str, Any]) -> dict[str, float]:
    ds = rows["datastates"]
    out = {}
    for name, r in rows.items():
        if name == "datastates":
            continue
        out[f"blocking: datastates / {name}"] = ds["blocking"] / r["blocking"]
        out[f"durable throughput: datastates / {name}"] = ds["durable_gbps"] / r["durable_gbps"]
        out[f"restore throughput: datastates / {name}"] = ds["restore_gbps"] / r["restore_gbps"]
    return out


def plot(rows: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, axes = plt.subplots(1, 3, figsize=(16, 0.55 * len(names) + 1.8))
    for ax, key, title in zip(axes, ("blocking", "durable_gbps", "restore_gbps"),
                              ("trainer blocked per checkpoint (s, log)", "durable throughput (GB/s)", "restore throughput (GB/s)")):
        vals = [rows[n][key] for n in names]
        colors = ["tab:orange" if "datastates" in n else "tab:gray" if n.startswith("raw") else "tab:blue" for n in names]
        ax.barh(names, vals, color=colors)
        ax.set_title(title)
        if key == "blocking":
            ax.set_xscale("log")
        ax.invert_yaxis()
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", default="/var/tmp/datastates-bench", help="a folder on the disk under test (not tmpfs)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--process-runs", type=int, default=0,
                        help="runs of DCP's process mode, after the others (default 0: with the 4.3 GB state it was "
                             "OOM-killed at 12.6 GB of shared memory on this 24 GiB machine, twice)")
    parser.add_argument("--skip", nargs="*", default=[], help="substrings of contender names to leave out")
    args = parser.parse_args()

    torch.set_num_threads(2)
    # one gloo rank: DCP's process mode needs a process group (file store, no ports)
    import tempfile

    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tempfile.mktemp(prefix='ds-bench-pg-')}")
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    state = gpt_state(layers=args.layers, dim=args.dim)
    nbytes = state_bytes(state)
    print(f"state: {nbytes / 1e9:.2f} GB in {len(tensors_of(state))} tensors; {args.runs} runs; root {args.root}")

    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    with datastatesd(args.root) as endpoint:
        wait_pool_mapped(endpoint)
        ds = datastates_contender(state, endpoint)
        t0 = time.perf_counter()
        first = ds.save(os.path.join(args.root, "warmup"))
        shutil.rmtree(os.path.join(args.root, "warmup"))
        print(f"datastates first snapshot of {nbytes / 1e9:.2f} GB (its one-time costs: the CUDA or in-place probe, "
              f"the daemon's first regions): blocking {first[0]:.3f} s, durable {time.perf_counter() - t0:.3f} s")
        stager = DefaultStager(StagingOptions(False, True, True, False))
        contenders = [
            torch_save(state),
            dcp_save(state, 1),
            dcp_save(state, 2),
            dcp_async(state, "thread", None, "default stager"),
            dcp_async(state, "thread", stager, "reused shm async stager"),
            raw_disk(nbytes, fresh=False),
            raw_disk(nbytes, fresh=True),
            dcp_datastates(state, endpoint),
            datastates_contender(state, endpoint, load="torch.load"),
            ds,
        ]
        contenders = [c for c in contenders if not any(s in c.name for s in args.skip)]
        for r in range(args.runs):
            print(f"round {r + 1}/{args.runs}", flush=True)
            run_round(contenders, args.root)
        # Process mode holds a second full copy of the state (shared memory plus its
        # worker's), so it runs last, alone, once the reused stager's buffers are freed:
        # run beside the others it was OOM-killed on this 24 GiB machine.
        stager.close()
        gc.collect()
        if args.process_runs:
            process = dcp_async(state, "process", None, "default stager")
            for r in range(args.process_runs):
                print(f"process mode {r + 1}/{args.process_runs}", flush=True)
                run_round([process], args.root)
            contenders.insert(-4, process)
    rows = summarize(contenders, nbytes)
    print_table(rows, nbytes, args.runs)
    rat = ratios(rows)
    print()
    for k, v in rat.items():
        print(f"{k:<78} {v:8.4f}")
    result = {"state_bytes": nbytes, "tensors": len(tensors_of(state)), "runs": args.runs, "medians": rows, "ratios": rat,
              "samples": {c.name: [s.__dict__ for s in c.samples] for c in contenders}}
    with open(os.path.join(args.out, "compare.json"), "w") as f:
        json.dump(result, f, indent=1)
    shutil.rmtree(args.root, ignore_errors=True)
    try:
        plot(rows, os.path.join(args.out, "compare.png"))
    except ImportError:  # the figures are in compare.json; only the picture needs the extra
        print(f"\nwrote {args.out}/compare.json; no compare.png: matplotlib is missing (pip install -e '.[bench]')")
    else:
        print(f"\nwrote {args.out}/compare.json and compare.png")


if __name__ == "__main__":
    main()
