"""The 1,200-share probe: do 1,200 snapshots of one GPU training state cost the trainer what its first ones did?

Why: each ``storage._share_cuda_()`` holds one of torch's IPC ref-counter slots
and events until the storage is freed, and past 1,000 events torch synchronizes the stream
on every share. A client that shared each storage at every snapshot reached that on the
second snapshot of bench/gpu.py's 592-storage state, and from then on every ``snapshot()``
waited for the whole GPU queue. A client must share each storage once.

One trainer holds those 592 storages (bench/gpu.py's GPT-2-shaped AdamW state, at small
dimensions so that 1,200 checkpoints stay cheap) and sends them through CUDA IPC. Before
each snapshot it queues a step of GPU work (``--step-ms`` of sleep, then an update of
every tensor), so a ``snapshot()`` that synchronizes pays for it; after it, ``wait()``.
Each block of 100 snapshots is one tag, committed at its end (the daemon keeps the last
two). Per block it prints the median ``snapshot()`` and ``wait()`` time, how many
``snapshot()`` calls returned with the trainer's stream already idle, the trainer's GPU
memory and ``client.cuda_shares``. A ``snapshot()`` that synchronizes finds the stream
idle every time, however fast it is, which a ratio of medians cannot see when it
synchronizes from the first snapshot on. It exits 1 if the shares pass the storage count,
more than 1% of the calls found the stream idle, the last block's median ``snapshot()``
is over 3x the first's, or the trainer's GPU memory changed after the first block.
Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpt_state, median, state_bytes, tensors_of  # noqa: E402
from gpu import add_daemon_args, bench_daemon, pool_pinning, to_cuda  # noqa: E402

BLOCK = 100
"""Snapshots per tag, and per line of the report."""
IDLE_SHARE = 0.01
"""The calls allowed to find the stream idle (a collector pause longer than a step)."""
CALIBRATION_CYCLES = 500_000_000
"""A quarter second of ``torch.cuda._sleep`` at an H200's clock: long enough to time."""


@dataclass(frozen=True)
class Block:
    """One block of snapshots: medians, and the trainer's state at its end."""

    tag: str
    snapshot_ms: float
    wait_ms: float
    idle: int
    """``snapshot()`` calls that returned with the trainer's stream idle."""
    allocated: int
    reserved: int
    shares: int

    def __str__(self) -> str:
        return (f"{self.tag:>5} {self.snapshot_ms:>12.2f} {self.wait_ms:>9.2f} {self.idle:>5} "
                f"{self.allocated / 2**20:>14.1f} {self.reserved / 2**20:>13.1f} {self.shares:>7}")


HEADER = (f"{'tag':>5} {'snapshot ms':>12} {'wait ms':>9} {'idle':>5} {'allocated MiB':>14} {'reserved MiB':>13} "
          f"{'shares':>7}")


def sleep_cycles(ms: float) -> int:
    """``torch.cuda._sleep`` cycles for ``ms`` milliseconds, from a sleep timed with CUDA events after a warm-up."""
    torch.cuda._sleep(CALIBRATION_CYCLES)  # the first launch, and the clock up from idle
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return int(CALIBRATION_CYCLES * ms / start.elapsed_time(end))


def run_block(client: Any, state: Any, tensors: list[torch.Tensor], root: str, tag: str, count: int,
              cycles: int) -> Block:
    """``count`` snapshots into tag ``tag``, each after a queued step, then its commit."""
    snapshot_s, wait_s, idle = [], [], 0
    for i in range(count):
        torch.cuda._sleep(cycles)
        torch._foreach_add_(tensors, 1.0)
        t0 = time.perf_counter()
        client.snapshot(state, os.path.join(root, tag, f"s{i}.pt"), tag=tag)
        t1 = time.perf_counter()
        idle += torch.cuda.current_stream().query()
        client.wait()
        snapshot_s.append(t1 - t0)
        wait_s.append(time.perf_counter() - t1)
    client.commit(tag).result(timeout=300)
    return Block(tag, median(snapshot_s) * 1e3, median(wait_s) * 1e3, idle, torch.cuda.memory_allocated(),
                 torch.cuda.memory_reserved(), client.cuda_shares)


def problems(blocks: list[Block], storages: int, calls: int) -> list[str]:
    """What went wrong over the run: shares past the storages, ``snapshot()`` calls that waited for the stream (more
    than ``IDLE_SHARE`` of ``calls``), a slower ``snapshot()``, trainer memory that moved."""
    first, last = blocks[0], blocks[-1]
    found = []
    if last.shares > storages:
        found.append(f"{last.shares} CUDA shares for {storages} storages: storages were shared again")
    idle = sum(b.idle for b in blocks)
    if idle > IDLE_SHARE * calls:
        found.append(f"{idle} snapshot() calls returned with the trainer's stream idle: they waited for its work")
    if last.snapshot_ms > 3 * first.snapshot_ms:
        found.append(f"snapshot() median {last.snapshot_ms:.2f} ms in the last block, over 3x the first's "
                     f"{first.snapshot_ms:.2f} ms")
    if (last.allocated, last.reserved) != (first.allocated, first.reserved):
        found.append(f"trainer GPU memory (allocated, reserved) went from {(first.allocated, first.reserved)} "
                     f"after the first block to {(last.allocated, last.reserved)}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshots", type=int, default=1200)
    parser.add_argument("--step-ms", type=float, default=20.0, help="GPU work queued before each snapshot")
    parser.add_argument("--layers", type=int, default=12, help="12 layers: 592 storages with the AdamW state")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir)")
    add_daemon_args(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_share_probe.py: no CUDA device here (torch.cuda.is_available() is False); nothing probed")
        return 0

    from datastates.client import Client

    state = to_cuda(gpt_state(layers=args.layers, dim=args.dim, vocab=args.vocab, ctx=args.ctx))
    tensors = [t for t in tensors_of(state) if t.is_cuda]
    storages = len({t.untyped_storage().data_ptr() for t in tensors})
    root = args.root or tempfile.mkdtemp(prefix="ds-share-probe-")
    os.makedirs(root, exist_ok=True)
    cycles = sleep_cycles(args.step_ms)
    blocks: list[Block] = []
    try:
        with bench_daemon(args, root, storage={"roots": [root], "keep_last": 2}, memory_restore="none",
                          host_memory="256MiB", chunk_size="8MiB") as daemon, \
                Client(daemon.endpoint, timeout=300, gpu_capture="ipc") as client:
            print(f"probe: {args.snapshots} snapshots of {storages} CUDA storages ({state_bytes(state) / 2**20:.1f} MiB) "
                  f"on {torch.cuda.get_device_name()}, a {args.step_ms:g} ms step queued before each; daemon "
                  f"copy_threads {daemon.copy_threads}, pool {pool_pinning(daemon.endpoint)}\n{HEADER}", flush=True)
            for first in range(0, args.snapshots, BLOCK):
                blocks.append(run_block(client, state, tensors, root, f"p{first // BLOCK}",
                                        min(BLOCK, args.snapshots - first), cycles))
                print(blocks[-1], flush=True)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    found = problems(blocks, storages, args.snapshots)
    print("probe: " + ("FAIL: " + "; ".join(found) if found else
                       f"PASS: {blocks[-1].shares} shares for {storages} storages, the stream busy after "
                       f"{1 - sum(b.idle for b in blocks) / args.snapshots:.1%} of snapshot() calls, median "
                       f"{blocks[0].snapshot_ms:.2f} -> {blocks[-1].snapshot_ms:.2f} ms, trainer GPU memory flat"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
