"""One aggregated file per rank, or several files per tag written in parallel?

Why: DeepSpeed writes a tag as several files (model states, optimizer states per rank);
the daemon can take them as several ``snapshot()`` calls or as one. This times both
through one datastatesd on the same state, interleaved, medians of ``--runs``, with
torch.save of the whole state in the same run as the yardstick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import datastatesd, gpt_state, median, state_bytes, wait_pool_mapped  # noqa: E402

from datastates.client import Client  # noqa: E402


def split(state: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """The state cut into ``parts`` files of about equal size: the module, then optimizer shards."""
    opt = state["optimizer"]["state"]
    keys = sorted(opt)
    shards = [{"optimizer_state": {k: opt[k] for k in keys[i::parts - 1]}} for i in range(parts - 1)]
    rest = {k: v for k, v in state.items() if k != "optimizer"}
    rest["param_groups"] = state["optimizer"]["param_groups"]
    return [rest, *shards]


def checkpoint(client: Client, pieces: list[dict[str, Any]], root: str, tag: str) -> float:
    t0 = time.perf_counter()
    for i, piece in enumerate(pieces):
        client.snapshot(piece, os.path.join(root, tag, f"part{i}.pt"), tag=tag)
    client.commit(tag).result()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--files", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", default="/var/tmp/datastates-files-bench")
    args = parser.parse_args()

    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    state = gpt_state(layers=args.layers, dim=args.dim)
    nbytes = state_bytes(state)
    layouts = {n: ([state] if n == 1 else split(state, n)) for n in args.files}
    times: dict[str, list[float]] = {f"{n} file(s)": [] for n in args.files}
    times["torch.save, 1 file"] = []
    with datastatesd(args.root) as endpoint:
        wait_pool_mapped(endpoint)
        with Client(endpoint, timeout=300) as client:
            checkpoint(client, [state], args.root, "warmup")  # moves the tensors into shared memory once
            step = 0
            for _ in range(args.runs):
                for n, pieces in layouts.items():
                    step += 1
                    times[f"{n} file(s)"].append(checkpoint(client, pieces, args.root, f"s{step}"))
                    shutil.rmtree(os.path.join(args.root, f"s{step}"))
                t0 = time.perf_counter()
                with open(os.path.join(args.root, "torch.pt"), "wb") as f:
                    torch.save(state, f)
                    os.fsync(f.fileno())
                times["torch.save, 1 file"].append(time.perf_counter() - t0)
                os.unlink(os.path.join(args.root, "torch.pt"))
    base = median(times["1 file(s)"])
    print(f"state {nbytes / 1e9:.2f} GB; until committed, medians of {args.runs}")
    for name, xs in times.items():
        print(f"  {name:<20} {median(xs):7.3f} s  {nbytes / median(xs) / 1e9:5.2f} GB/s  time / 1 file: {median(xs) / base:5.2f}")
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
