"""Soak: thousands of snapshots and commits through one daemon, watching that nothing grows.

Why: a long job saves tens of thousands of times through the same daemon. A few bytes held
per save, a descriptor or thread not closed, a file left in /dev/shm or under the root,
would add up to an out-of-memory kill or a full /dev/shm days into a run.

One ``datastatesd`` (``storage.keep_last`` retention, ``memory_restore: latest``) and one
trainer, a process of its own, which snapshots a GPT-shaped state (weights, AdamW state,
objects), waits for the copy, changes the state in place and commits, ``--saves`` times.
Every ``--every`` saves the trainer settles (its commits resolved, the daemon idle) and the
bench samples both processes from /proc: resident memory (VmRSS), open descriptors,
threads; the /dev/shm entries and bytes the two put there (the daemon's replica folder
and lock file, the trainer's decision folder, torch segments of either, and anything else
in /dev/shm either maps or holds open); and the entries and bytes under the root.

The verdict, over the samples from 10% of the run on (the warm-up fills caches, pools and
the daemon's bounded histories): resident memory and bytes within 1% of their value at the
10% mark, every count (descriptors, threads, entries) exactly flat.

By default each commit resolves before the next snapshot, as in a loop with steps between
its saves. ``--overlap 1`` leaves one unresolved, saves back to back: then whether a replica
is written over its predecessor's pages (which the daemon keeps mapped, two descriptors)
depends on whether the previous commit had retired that predecessor yet, so the daemon's
descriptors move between two values, bounded. It also runs two retention passes at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, gpt_state, state_bytes, tensors_of  # noqa: E402

SHM = "/dev/shm"
SIZES = ("daemon_rss", "trainer_rss", "shm_bytes", "root_bytes")
"""Metrics that may move a little, held within a tolerance: resident memory (the allocator's pages), and bytes
(a commit marker names the run's commit sequence number, a few bytes longer at each power of ten)."""
COUNTS = ("daemon_fds", "trainer_fds", "daemon_threads", "trainer_threads", "shm_entries", "root_entries")
"""Metrics that must not move at all once warmed up."""
METRICS = ("daemon_rss", "daemon_fds", "daemon_threads", "trainer_rss", "trainer_fds", "trainer_threads",
           "shm_entries", "shm_bytes", "root_entries", "root_bytes")
READY = "soak-ready "
"""The trainer's line saying it has settled after that many saves, and waits for the bench to sample it."""


def sized_state(mb: float) -> dict[str, Any]:
    """A GPT-shaped training state (bench/common.py's) of about ``mb`` MB: fp32 weights, AdamW exp_avg and exp_avg_sq.

    The width is the largest power of two (64 to 1024) that still leaves room for four layers.
    """
    params = mb * 1e6 / 12  # 4 bytes for each of weight, exp_avg and exp_avg_sq

    def per_layer(d: int) -> int:
        return 12 * d * d + 13 * d

    dim = 64
    while dim < 1024 and 4 * per_layer(2 * dim) <= params:
        dim *= 2
    layers = max(1, int((params - 2 * dim * dim) // per_layer(dim)))
    vocab = max(1, int((params - layers * per_layer(dim) - dim * dim - 2 * dim) // dim))
    return gpt_state(layers=layers, dim=dim, vocab=vocab, ctx=dim)


def _status_field(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/{pid}/status has no {key}")


def process_stats(pid: int) -> dict[str, int]:
    """Resident memory in bytes (VmRSS), open descriptors and threads of process ``pid``."""
    return {"rss": _status_field(pid, "VmRSS") * 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": len(os.listdir(f"/proc/{pid}/task"))}


def open_files(pid: int) -> list[str]:
    """What process ``pid``'s descriptors are open on (sockets, pipes, files): to name a descriptor that moved."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return sorted(targets)


def _shm_paths_used(pid: int) -> set[str]:
    """The /dev/shm paths ``pid`` maps or holds open."""
    used = set()
    with contextlib.suppress(FileNotFoundError), open(f"/proc/{pid}/maps") as f:
        used.update(line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and f" {SHM}/" in line)
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith(SHM + "/"):
                used.add(target)
    return used


def tree_usage(path: str, blocks: bool = False) -> tuple[int, int]:
    """Entries (files, folders, links) under ``path``, itself included, and the bytes of its regular files:
    their sizes, or with ``blocks`` the space they take (what a tmpfs holds in memory)."""
    entries = size = 0
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        entries += 1
        if not os.path.isdir(path) or os.path.islink(path):
            return entries, st.st_blocks * 512 if blocks else st.st_size
    for folder, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(os.path.join(folder, name))
                entries += 1
                if name in files and not os.path.islink(os.path.join(folder, name)):
                    size += st.st_blocks * 512 if blocks else st.st_size
    return entries, size


@dataclass
class Watched:
    """The two processes of a soak and where they keep files."""

    daemon_pid: int
    trainer_pid: int
    replica_folder: str
    """The daemon's folder in /dev/shm (its ``status``): ``datastates-<uid>-<owner>``."""
    root: str

    def shm_entries(self) -> list[str]:
        """What the daemon and the trainer hold in /dev/shm: the entries named after them, and any other either
        maps or holds open. Other daemons and jobs of this node have their own entries there, never counted."""
        uid = os.geteuid()
        owner = os.path.basename(self.replica_folder)[len(f"datastates-{uid}-"):]
        ours = re.compile(rf"datastates-{uid}-client-{self.trainer_pid}-[0-9a-f]+"
                          rf"|torch_({self.trainer_pid}|{self.daemon_pid})_.*")
        named = {os.path.join(SHM, n) for n in os.listdir(SHM) if ours.fullmatch(n)}
        named |= {self.replica_folder, os.path.join(SHM, f"datastates-{uid}-daemons", f"{owner}.lock")}
        for pid in (self.daemon_pid, self.trainer_pid):
            for path in _shm_paths_used(pid):  # an entry, or a file inside one: the top entry counts
                named.add(os.path.join(SHM, os.path.relpath(path, SHM).split(os.sep)[0]))
        lock_folder = os.path.join(SHM, f"datastates-{uid}-daemons")
        named.discard(lock_folder)  # every daemon of this user locks there; only our own lock file counts
        return sorted(named)

    def sample(self, saves: int) -> dict[str, Any]:
        """Every metric now, after ``saves`` saves."""
        out: dict[str, Any] = {"saves": saves, "time": time.time()}
        for who, pid in (("daemon", self.daemon_pid), ("trainer", self.trainer_pid)):
            out.update({f"{who}_{k}": v for k, v in process_stats(pid).items()})
            out[f"{who}_open"] = open_files(pid)
        shm = [tree_usage(p, blocks=True) for p in self.shm_entries()]
        out["shm_entries"], out["shm_bytes"] = sum(e for e, _ in shm), sum(b for _, b in shm)
        out["root_entries"], out["root_bytes"] = tree_usage(self.root)
        return out


def locks_settled(status: Callable[[], dict[str, Any]], timeout: float = 30) -> None:
    """Wait until the daemon (its ``status()``) has no replica lock, unlock or hand-over queued (daemon/replica/locks.py
    does them on a thread of its own, moments after each commit): its resident memory counts a locked replica's
    pages once more, and its descriptors one per lock, so a sample taken while one is still queued would move by
    a replica. TimeoutError if they never settle."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not status()["replicas"]["locks_pending"]:
            return
        time.sleep(0.02)
    raise TimeoutError(f"the daemon's replica locks were still queued after {timeout} s")


def soak(endpoint: str, root: str, saves: int, every: int, state_mb: float, overlap: int = 0,
         on_sample: Callable[[dict[str, Any]], None] = lambda s: None, timeout: float = 600) -> list[dict[str, Any]]:
    """Run a trainer process of ``saves`` saves of a ``state_mb`` state under ``root`` through the daemon at
    ``endpoint``; the samples taken before its first save and after every ``every`` saves."""
    from datastates.client.connection import Connection
    from datastates.protocol import messages as m

    conn = Connection(endpoint)  # one for the whole run: one per poll would show in the daemon's descriptors
    status = conn.call(m.Status(), 5).status
    cmd = [sys.executable, os.path.abspath(__file__), "--trainer", endpoint, "--root", root, "--saves", str(saves),
           "--every", str(every), "--state-mb", str(state_mb), "--overlap", str(overlap)]
    samples: list[dict[str, Any]] = []
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        watched = Watched(status["daemon"]["pid"], proc.pid, status["replicas"]["folder"], root)
        try:
            for line in proc.stdout:
                if line.startswith(READY):
                    locks_settled(lambda: conn.call(m.Status(), 5).status)
                    samples.append(watched.sample(int(line[len(READY):])))
                    on_sample(samples[-1])
                    proc.stdin.write("\n")
                    proc.stdin.flush()
                else:
                    sys.stdout.write(line)
            rc = proc.wait(timeout)
        finally:
            conn.close()
            if proc.poll() is None:
                proc.kill()
    if rc != 0 or not samples or samples[-1]["saves"] != saves:
        raise RuntimeError(f"the soak's trainer exited with {rc} after {samples[-1]['saves'] if samples else 0} saves")
    return samples


def verdict(samples: list[dict[str, Any]], warmup: float = 0.1) -> dict[str, dict[str, Any]]:
    """Per metric, over the samples from ``warmup`` of the run on: its value at that mark (``ref``), min, max,
    and the largest deviation from ``ref`` as a fraction of it; with the first and the last value of the run."""
    mark = warmup * samples[-1]["saves"]
    steady = [s for s in samples if s["saves"] >= mark]
    out = {}
    for metric in METRICS:
        values = [s[metric] for s in steady]
        ref = values[0]
        out[metric] = {"first": samples[0][metric], "ref": ref, "ref_saves": steady[0]["saves"], "last": values[-1],
                       "min": min(values), "max": max(values),
                       "max_dev": max(abs(v - ref) for v in values) / ref if ref else float(max(values) != min(values))}
    return out


def _fmt(metric: str, value: float) -> str:
    return f"{value / 2**20:.1f} MiB" if metric.endswith(("rss", "bytes")) else str(value)


def print_samples(samples: list[dict[str, Any]]) -> None:
    print("| saves | " + " | ".join(METRICS) + " |")
    print("|---:|" + "---:|" * len(METRICS))
    for s in samples:
        print(f"| {s['saves']} | " + " | ".join(_fmt(m, s[m]) for m in METRICS) + " |")


def print_verdict(v: dict[str, dict[str, Any]], tolerance: float) -> bool:
    """The summary table and each metric's verdict; whether all hold."""
    ref_saves = v[METRICS[0]]["ref_saves"]
    print(f"\n| metric | first | at {ref_saves} saves | last | min | max | max deviation | verdict |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    ok_all = True
    for metric in METRICS:
        r = v[metric]
        if metric in SIZES:
            ok = r["max_dev"] <= tolerance
            rule = f"within {tolerance:.0%}"
        else:
            ok = r["min"] == r["max"]
            rule = "flat"
        ok_all &= ok
        print(f"| {metric} | " + " | ".join(_fmt(metric, r[k]) for k in ("first", "ref", "last", "min", "max"))
              + f" | {r['max_dev']:.3%} | {rule}: {'yes' if ok else 'NO'} |")
    return ok_all


def settle(client: Any, timeout: float = 600) -> None:
    """Wait until the daemon has nothing in flight: no snapshot pending, no commit, no tier transfer."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        if not st["pending"] and not st["commits_pending"] and not st["tier_transfers"]["pending"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon did not settle within {timeout} s")
        time.sleep(0.01)


def trainer(args: argparse.Namespace) -> int:
    """The trainer process: snapshot, wait, change the state in place, commit; settle and report every ``every``."""
    from datastates.client import Client

    state = sized_state(args.state_mb)
    step = state["optimizer"]["state"][0]["step"]
    with Client(args.trainer, timeout=600) as client:

        def ready(saves: int) -> None:
            settle(client)
            print(f"{READY}{saves}", flush=True)
            sys.stdin.readline()  # the bench has sampled

        ready(0)
        commits = []
        for i in range(1, args.saves + 1):
            tag = f"step{i:08d}"
            client.snapshot(state, os.path.join(args.root, tag, "rank0.pt"))
            client.wait()
            state["global_steps"] = i  # the training step: the state changes in place once the copy is done
            step.add_(1)
            commits.append(client.commit(tag))
            while len(commits) > args.overlap:  # with 1, as integrations do: the commit resolves during the next step
                commits.pop(0).result()
            if i % args.every == 0 or i == args.saves:
                while commits:
                    commits.pop(0).result()
                ready(i)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=100, help="sample every N saves")
    parser.add_argument("--state-mb", type=float, default=1.0, help="size of the trainer's state, MB (1 and 500)")
    parser.add_argument("--keep-last", type=int, default=3, help="the daemon's storage.keep_last")
    parser.add_argument("--tolerance", type=float, default=0.01, help="memory's allowed deviation after warm-up")
    parser.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir)")
    parser.add_argument("--json", default=None, help="write the samples and the verdict here")
    parser.add_argument("--overlap", type=int, default=0,
                        help="commits left unresolved when the next snapshot is taken (default: none)")
    parser.add_argument("--trainer", default=None, help=argparse.SUPPRESS)  # the endpoint: run as the trainer
    args = parser.parse_args()
    if args.trainer:
        return trainer(args)
    root = args.root or tempfile.mkdtemp(prefix="ds-bench-soak-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    state = sized_state(args.state_mb)  # the trainer builds its own: this one is for the figures only
    nbytes, ntensors = state_bytes(state), len(tensors_of(state))
    del state
    budget = 2 * nbytes + (64 << 20)  # the newest replica and its spare, written over by the next one
    host = max(256 << 20, 2 * nbytes)
    print(f"soak: {args.saves} saves of {nbytes / 1e6:.1f} MB in {ntensors} tensors"
          f", keep_last {args.keep_last}, sampling every {args.every}; root {root}", flush=True)
    try:
        samples, seconds = _run(args, root, budget, host)
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.saves} saves in {seconds:.0f} s ({seconds / args.saves * 1e3:.1f} ms per save)\n")
    print_samples(samples)
    v = verdict(samples)
    ok = print_verdict(v, args.tolerance)
    if args.json:
        with open(args.json, "w") as f:
            given = {k: getattr(args, k) for k in ("saves", "every", "state_mb", "keep_last", "overlap", "tolerance")}
            json.dump({"args": given, "state_bytes": nbytes, "seconds": seconds, "samples": samples, "verdict": v,
                       "ok": ok}, f, indent=1)
    return 0 if ok else 1


def _run(args: argparse.Namespace, root: str, budget: int, host: int) -> tuple[list[dict[str, Any]], float]:
    """The soak through a daemon of its own: its samples, and how long the saves took."""
    with datastatesd(root, storage={"roots": [root], "keep_last": args.keep_last}, memory_restore="latest",
                     memory_restore_budget=budget, host_memory=host) as endpoint:
        t0 = time.monotonic()
        samples = soak(endpoint, root, args.saves, args.every, args.state_mb, args.overlap, timeout=3600,
                       on_sample=lambda s: print(f"{s['saves']:>6} saves, {time.monotonic() - t0:7.1f} s: " + ", ".join(
                           f"{m} {_fmt(m, s[m])}" for m in METRICS), flush=True))
        return samples, time.monotonic() - t0


if __name__ == "__main__":
    sys.exit(main())
