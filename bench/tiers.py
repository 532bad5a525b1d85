"""Storage tiers: how soon a checkpoint is committed with /dev/shm as the first tier, against disk-only saves.

Why: with ``storage.tiers`` the commit answers once the tag is committed on the fast tier,
and the copy to the slow one runs behind the training. Per run, one GPT-shaped state is
saved (contenders interleaved, each into a fresh tag):

- tiered: ``snapshot`` + ``commit`` with tiers [/dev/shm, disk]; ``commit()`` answers for /dev/shm;
- tiered, until on disk: the same save, until the daemon has committed it on the disk tier too;
- disk only: ``snapshot`` + ``commit`` with the disk as the only root;
- torch.save: into a file on the disk, fsynced;
- DCP: ``torch.distributed.checkpoint.save`` onto the disk, fsynced.

Then restores with a cold page cache: the fast tier's copy against the disk tier's. It
prints medians over ``--runs`` and the ratios.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, drop_caches, fsync_tree, gpt_state, print_medians, state_bytes, tensors_of, timed  # noqa: E402

import datastates  # noqa: E402
from datastates.client import Client, daemon_status  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
POLL_S = 0.01


def committed_on(endpoint: str, tag: str, tier: str) -> bool:
    for entry in daemon_status(endpoint)["tier_transfers"]["tags"]:
        if entry["tag"] == tag:
            return any(c["tier"] == tier and c["state"] == "committed" for c in entry["tiers"])
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", default=None, help="disk folder for the checkpoints (default: a fresh temp dir)")
    args = parser.parse_args()
    disk = args.root or tempfile.mkdtemp(prefix="ds-bench-tiers-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    shm = tempfile.mkdtemp(prefix="ds-bench-tiers-", dir="/dev/shm")
    state = gpt_state(layers=args.layers, dim=args.dim)
    nbytes = state_bytes(state)
    print(f"state: {nbytes / 1e9:.2f} GB in {len(tensors_of(state))} tensors; {args.runs} runs; disk {disk}")
    tiers = {"tiers": [{"name": "shm", "path": shm, "shared": False, "keep_last": 1},
                       {"name": "disk", "path": os.path.join(disk, "tiered"), "keep_last": 1}]}
    times: dict[str, list[float]] = {n: [] for n in ("tiered", "tiered, until on disk", "disk only", "torch.save",
                                                     "dcp", "restore shm tier", "restore disk tier")}
    common = {"host_memory": "1GiB", "memory_restore": "none"}
    try:
        with datastatesd(disk, **common, storage=tiers) as tiered_ep, \
                datastatesd(disk, **common, storage={"roots": [disk], "keep_last": 1}) as disk_ep, \
                Client(tiered_ep, timeout=600) as tiered, Client(disk_ep, timeout=600) as plain:

            def save(client: Client, root: str, tag: str) -> None:
                client.snapshot(state, os.path.join(root, tag, "rank0.pt"))
                client.wait()
                client.commit(tag).result()

            def tiered_until_disk(tag: str) -> None:
                save(tiered, os.path.join(shm, "run"), tag)
                while not committed_on(tiered_ep, tag, "disk"):
                    time.sleep(POLL_S)

            def torch_save(tag: str) -> None:
                path = os.path.join(disk, "ts", tag)
                os.makedirs(path)
                torch.save(state, os.path.join(path, "rank0.pt"))
                fsync_tree(path)

            def dcp_save(tag: str) -> None:
                path = os.path.join(disk, "dcp", tag)
                dcp.save({"state": state}, checkpoint_id=path, no_dist=True)
                fsync_tree(path)

            contenders: dict[str, Callable[[str], Any]] = {
                "tiered": lambda tag: save(tiered, os.path.join(shm, "run"), tag),
                "tiered, until on disk": tiered_until_disk,
                "disk only": lambda tag: save(plain, os.path.join(disk, "plain"), tag),
                "torch.save": torch_save,
                "dcp": dcp_save,
            }
            step = 0
            for r in range(args.runs):
                for name, fn in contenders.items():
                    step += 1
                    tiered_idle = lambda: not daemon_status(tiered_ep)["tier_transfers"]["pending"]  # noqa: E731
                    while not tiered_idle():  # no contender pays for the previous one's background copy
                        time.sleep(POLL_S)
                    gc.collect()
                    seconds, _ = timed(fn, f"step{step}")
                    times[name].append(seconds)
                    for peer in ("ts", "dcp"):  # outside the timing; datastates' own keep_last tidies its tags
                        shutil.rmtree(os.path.join(disk, peer), ignore_errors=True)
                print(f"run {r + 1}/{args.runs}: " + ", ".join(f"{n} {times[n][-1]:.3f} s" for n in contenders), flush=True)
            tag = datastates.latest(os.path.join(shm, "run"))
            for _ in range(args.runs):
                for name, root in (("restore shm tier", shm), ("restore disk tier", os.path.join(disk, "tiered"))):
                    gc.collect()
                    drop_caches(disk)
                    seconds, _ = timed(datastates.load, os.path.join(root, "run", tag, "rank0.pt"))
                    times[name].append(seconds)
                    del _
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.root is None:
            shutil.rmtree(disk, ignore_errors=True)
    med = print_medians(times, nbytes)
    for peer in ("torch.save", "dcp", "disk only"):
        print(f"time to commit: tiered / {peer:<12} {med['tiered'] / med[peer]:8.3f}")
    for peer in ("torch.save", "dcp", "disk only"):
        print(f"time until on disk: tiered / {peer:<12} {med['tiered, until on disk'] / med[peer]:8.3f}")
    print(f"restore time: shm tier / disk tier {med['restore shm tier'] / med['restore disk tier']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
