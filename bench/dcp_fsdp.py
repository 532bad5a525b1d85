"""FSDP2 training checkpointed with DCP: datastates beneath ``dcp.async_save`` against DCP's own, in real ranks.

Why: a job that shards with FSDP2 checkpoints with ``torch.distributed.checkpoint``; what it
gains from datastates is measured in its own loop, with torchrun's ranks, not in one process.
Two ranks (torchrun, gloo, CPU, ``OMP_NUM_THREADS=1``) train a
GPT-shaped model (transformer blocks of Linear layers; by default 42 M parameters: about
0.5 GB of model plus AdamW state) with ``fully_shard``, against one ``datastatesd``. Phases,
each a torchrun launch that prints one JSON line per rank and result (rank side:
``bench/dcp_fsdp_rank.py``, the model ``bench/dcp_fsdp_model.py``):

1. train: ``--runs`` rounds, contenders interleaved (the order flips every run), each a
   loop of ``--steps`` steps with a checkpoint every ``--every``:
   ``none`` (the baseline step time); ``dcp``, DCP's ``async_save`` with ``FileSystemWriter``
   and a reused ``DefaultStager`` in the configuration found fastest here, unless
   ``--dcp-config`` names one: short loops of the thread and the process executor, each with
   shared, private and (where CUDA is; DCP ignores the flag without it) pinned staging
   memory, interleaved with loops of no checkpoint, the lowest slowdown wins; ``datastates``, ``async_save`` through
   ``DatastatesStorageWriter(client)`` with ``client.protect(opt)`` as the fence. Every
   contender first takes one untimed checkpoint (its one-time costs), and each run's last
   checkpoint is loaded back (one key) and compared with the value it saved.
2. save4: four ranks save the same model through datastates once, for the reshard load.
3. load: per run, with the ranks otherwise idle: a raw O_DIRECT write of the checkpoint's
   bytes (64 MiB writes, ``--raw-threads``, fsync), a DCP and a datastates save (the save
   call to the future resolved), then ``dcp.load`` into another FSDP model and optimizer
   (``get_state_dict`` / ``set_state_dict``): cold (page cache dropped per file) through DCP's
   ``FileSystemReader`` and ``DatastatesStorageReader()``, from the daemon's memory through
   ``DatastatesStorageReader(client)`` (the newest tag's replica; the source it took is
   checked), and the 4-rank checkpoint cold (4 -> 2). Every load is checked against the state saved.

It prints every run as it ends, then the medians and the ratios, each beside its target:
training slowdown (mean step time with checkpoints / without) and datastates' overhead
(slowdown - 1) over DCP's; the time the loop is blocked per checkpoint (the save call plus the
fence, plus any wait for the previous checkpoint) over DCP's; durable throughput over the raw
write's; the cold load over ``FileSystemReader``'s, the memory load over it, and 4 -> 2 over 2 -> 2.
Then the storage layer's part alone, with no targets: each idle save from the writer's ``write_data`` on
(before it, DCP plans: its local and global plans over the process group, the same for any storage layer), and
each load's ``read_data``, over the raw write and ``FileSystemReader``'s.
JSON to ``bench/results/dcp_fsdp.json``; the ranks' stderr to ``dcp_fsdp.log`` beside it.

    .venv/bin/python bench/dcp_fsdp.py                      # the default size, 3 runs: about 11 min here
    .venv/bin/python bench/dcp_fsdp.py --dcp-config thread+shm  # without the pre-measurement: about 8 min
    .venv/bin/python bench/dcp_fsdp.py --layers 1 --dim 128 --vocab 1024 --steps 10 --runs 2  # a check, under 1 min

Absolute times drift on this machine (a shared virtual disk); the ratios, measured in one run, are what to compare.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import BIN, datastatesd, median, wait_pool_mapped  # noqa: E402

RANK_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dcp_fsdp_rank.py")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CONFIGS = ("auto", "thread+shm", "thread+private", "thread+pinned", "process+shm", "process+pinned")
"""``auto``, or one of the rank side's DCP_CONFIGS (not imported here: the parent stays free of torch.distributed)."""

TARGETS: dict[str, tuple[str, float]] = {
    "slowdown datastates": ("<=", 1.10),
    "overhead datastates / dcp": ("<=", 0.5),
    "blocked datastates / dcp": ("<=", 0.1),
    "durable datastates / raw O_DIRECT": (">=", 0.85),
    "cold load datastates / FileSystemReader": ("<=", 1.0),
    "memory load datastates / FileSystemReader": ("<=", 0.3),
    "reshard load 4->2 / 2->2": ("<=", 1.2),
}
"""The targets, by the name each ratio is printed under."""


def params_of(layers: int, dim: int, vocab: int, ctx: int) -> int:
    """The GPT's parameters (rank side's ``GPT``): embeddings, blocks, final norm, untied head."""
    block = 2 * 2 * dim + (3 * dim * dim + 3 * dim) + (dim * dim + dim) + (4 * dim * dim + 4 * dim) + (4 * dim * dim + dim)
    return vocab * dim + ctx * dim + layers * block + 2 * dim + dim * vocab


def torchrun(phase: str, nproc: int, args: dict[str, Any], endpoint: str, log: Any,
             on_result: Any = None) -> list[dict[str, Any]]:
    """One phase in ``nproc`` ranks; their RESULT lines, each handed to ``on_result`` as it comes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DATASTATES_ENDPOINT": endpoint}
    cmd = [os.path.join(BIN, "torchrun"), "--standalone", f"--nproc-per-node={nproc}", RANK_MAIN, phase, json.dumps(args)]
    log.write(f"\n==== {phase}: {' '.join(cmd)}\n")
    log.flush()
    results: list[dict[str, Any]] = []
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=log, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("RESULT "):
                log.write(line)
                continue
            results.append(json.loads(line[len("RESULT "):]))
            if on_result is not None:
                on_result(results[-1])
    if proc.returncode != 0:
        raise RuntimeError(f"phase {phase} failed (torchrun exited {proc.returncode}); see {log.name}")
    return results


class RunPrinter:
    """Prints each (contender, run) once every rank's line for it is in."""

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.lines: dict[tuple[str, str, int], list[dict[str, Any]]] = defaultdict(list)

    def __call__(self, r: dict[str, Any]) -> None:
        if r["kind"] == "dcp_config" and r["rank"] == 0:
            tried = ", ".join(f"{k} {v:.3f}" for k, v in r["slowdowns"].items())
            print(f"dcp configuration: {r['config']}" + (f" (median slowdowns: {tried})" if tried else ""), flush=True)
            return
        key = (r["kind"], r.get("contender") or r.get("config", ""), r.get("run", 0))
        self.lines[key].append(r)
        if len(self.lines[key]) < self.nproc:
            return
        rows = self.lines[key]
        if r["kind"] == "probe":
            if any("error" in x for x in rows):
                print(f"  probe {key[1]:<20} failed: {next(x['error'] for x in rows if 'error' in x)}", flush=True)
            else:
                t = train_row(rows)
                print(f"  probe round {key[2]} {key[1]:<20} step {1e3 * t['step_s']:7.1f} ms  "
                      f"blocked/ckpt {1e3 * t['blocked_s']:7.1f} ms", flush=True)
        elif r["kind"] == "train":
            t = train_row(rows)
            print(f"  run {key[2]} {key[1]:<22} step {1e3 * t['step_s']:7.1f} ms  blocked/ckpt {1e3 * t['blocked_s']:7.1f} ms "
                  f"(call {1e3 * t['call_s']:.1f}, fence {1e3 * t['fence_s']:.1f}, previous {1e3 * t['wait_prev_s']:.1f})  "
                  f"durable {t['durable_s']:6.2f} s  check {t['check']}", flush=True)
        elif r["kind"] == "load":
            x = rows[0]
            print(f"  load run {x['run']}: raw write {x['raw_write_s']:.2f} s, durable dcp {x['durable_dcp_s']:.2f} s, "
                  f"datastates {x['durable_ds_s']:.2f} s; load fs {x['load_fs_s']:.2f} s, datastates {x['load_ds_s']:.2f} s, "
                  f"memory {x['load_memory_s']:.2f} s ({','.join(x['memory_sources'])}), 4->2 {x['load_reshard_s']:.2f} s; "
                  f"checks {checks_of(rows)}", flush=True)


def train_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One contender's run over its ranks: the slowest rank's figures (the ranks step in lockstep)."""
    n = max(1, rows[0]["checkpoints"])
    per_rank_blocked = [(r["save_call_s"] + r["fence_s"] + r["wait_prev_s"]) / n for r in rows]
    return {
        "step_s": max(sum(r["step_s"]) / len(r["step_s"]) for r in rows),
        "blocked_s": max(per_rank_blocked),
        "call_s": max(r["save_call_s"] / n for r in rows),
        "fence_s": max(r["fence_s"] / n for r in rows),
        "wait_prev_s": max(r["wait_prev_s"] / n for r in rows),
        "state_dict_s": max(r["state_dict_s"] / n for r in rows),
        "durable_s": max(median(r["durable_s"]) for r in rows) if rows[0]["durable_s"] else 0.0,
        "drain_s": max(r["drain_s"] for r in rows),
        "bytes": sum(r["ckpt_bytes"] for r in rows),
        "checkpoints": rows[0]["checkpoints"],
        "check": "-" if rows[0]["check_ok"] is None else "ok" if all(r["check_ok"] for r in rows) else "FAILED",
    }


def checks_of(rows: list[dict[str, Any]]) -> str:
    bad = {k: v for r in rows for k, v in r["checks"].items() if v is not True}
    memory = {s for r in rows for s in r["memory_sources"]}
    if memory != {"memory"}:  # the memory load read storage: it would be timed as a memory load
        bad["memory source"] = sorted(memory)
    return "ok" if not bad else f"FAILED {bad}"


def summarize(results: list[dict[str, Any]], loads: list[dict[str, Any]]) -> dict[str, Any]:
    runs: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    grouped: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        grouped[(r["contender"], r["run"])].append(r)
    for (name, run), rows in grouped.items():
        runs["dcp" if name.startswith("dcp") else name][run] = train_row(rows)
    for name, per_run in runs.items():
        for run, row in per_run.items():
            row["slowdown"] = row["step_s"] / runs["none"][run]["step_s"]
    train = {name: {k: median([row[k] for row in per_run.values()])
                    for k in ("step_s", "slowdown", "blocked_s", "call_s", "fence_s", "wait_prev_s", "state_dict_s",
                              "durable_s", "drain_s")} | {"checks": sorted({row["check"] for row in per_run.values()})}
             for name, per_run in runs.items()}
    first = [r for r in loads if r["rank"] == 0]
    load = {k: median([r[k] for r in first]) for k in first[0] if k.endswith("_s") and not k.startswith("metadata")}
    load |= {k: median([max(r[k] for r in loads if r["run"] == x["run"]) for x in first])  # the coordinator's
             for k in first[0] if k.startswith("metadata")}
    load["bytes"] = first[0]["bytes"]
    load["checks"] = sorted({checks_of([r for r in loads if r["run"] == x["run"]]) for x in first})
    ds, dc = train["datastates"], train["dcp"]
    ratios = {
        "slowdown datastates": ds["slowdown"],
        "slowdown dcp": dc["slowdown"],
        "overhead datastates / dcp": (ds["slowdown"] - 1) / (dc["slowdown"] - 1) if dc["slowdown"] > 1 else float("nan"),
        "blocked datastates / dcp": ds["blocked_s"] / dc["blocked_s"],
        "durable datastates / raw O_DIRECT": median([r["raw_write_s"] / r["durable_ds_s"] for r in first]),
        "durable dcp / raw O_DIRECT": median([r["raw_write_s"] / r["durable_dcp_s"] for r in first]),
        "durable throughput in training datastates / dcp": dc["durable_s"] / ds["durable_s"],
        "cold load datastates / FileSystemReader": median([r["load_ds_s"] / r["load_fs_s"] for r in first]),
        "memory load datastates / FileSystemReader": median([r["load_memory_s"] / r["load_fs_s"] for r in first]),
        "reshard load 4->2 / 2->2": median([r["load_reshard_s"] / r["load_ds_s"] for r in first]),
        # the storage layer's part alone, DCP's own planning and collectives left out (no targets: what a faster
        # storage layer can change)
        "durable after planning datastates / raw O_DIRECT": median(
            [r["raw_write_s"] / (r["durable_ds_s"] - r["planned_ds_s"]) for r in first]),
        "durable after planning dcp / raw O_DIRECT": median(
            [r["raw_write_s"] / (r["durable_dcp_s"] - r["planned_dcp_s"]) for r in first]),
        "read_data memory / FileSystemReader": median([r["read_memory_s"] / r["read_fs_s"] for r in first]),
        "read_data cold datastates / FileSystemReader": median([r["read_ds_s"] / r["read_fs_s"] for r in first]),
        "read_data reshard 4->2 / 2->2": median([r["read_reshard_s"] / r["read_ds_s"] for r in first]),
    }
    return {"train": train, "train_runs": {n: {str(k): v for k, v in p.items()} for n, p in runs.items()},
            "load": load, "ratios": ratios}


def print_summary(s: dict[str, Any], runs: int) -> None:
    print(f"\nmedians of {runs} runs (slowest rank of each run; per checkpoint)")
    print(f"{'contender':<12}{'step ms':>9}{'slowdown':>10}{'blocked ms':>12}{'call ms':>9}{'fence ms':>10}"
          f"{'previous ms':>13}{'state_dict ms':>15}{'durable s':>11}{'drain s':>9}  checks")
    for name, t in s["train"].items():
        print(f"{name:<12}{1e3 * t['step_s']:9.1f}{t['slowdown']:10.3f}{1e3 * t['blocked_s']:12.1f}{1e3 * t['call_s']:9.1f}"
              f"{1e3 * t['fence_s']:10.1f}{1e3 * t['wait_prev_s']:13.1f}{1e3 * t['state_dict_s']:15.1f}"
              f"{t['durable_s']:11.2f}{t['drain_s']:9.2f}  {','.join(t['checks'])}")
    ld = s["load"]
    gb = ld["bytes"] / 1e9
    print(f"\nidle saves and loads of {gb:.3f} GB (both ranks):")
    for key, label in (("raw_write_s", "raw O_DIRECT write"), ("durable_dcp_s", "dcp async_save, durable"),
                       ("durable_ds_s", "datastates async_save, durable"), ("load_fs_s", "dcp.load FileSystemReader, cold"),
                       ("load_ds_s", "dcp.load DatastatesStorageReader(), cold"),
                       ("load_memory_s", "dcp.load DatastatesStorageReader(client), memory"),
                       ("load_reshard_s", "dcp.load 4 -> 2 DatastatesStorageReader(), cold")):
        meta, read = (ld.get(key.replace("load_", f"{part}_")) for part in ("metadata", "read"))
        planned = ld.get(key.replace("durable_", "planned_"))
        print(f"  {label:<52}{ld[key]:8.3f} s {gb / ld[key]:7.2f} GB/s"
              + (f"   of which read_metadata {meta:.3f} s, read_data {read:.3f} s" if key.startswith("load_") else "")
              + (f"   of which DCP's planning {planned:.3f} s" if key.startswith("durable_") else ""))
    print(f"  checks: {', '.join(ld['checks'])}")
    print("\nratios (the target beside each):")
    for name, value in s["ratios"].items():
        target = TARGETS.get(name)
        verdict = ""
        if target is not None:
            op, bound = target
            ok = value <= bound if op == "<=" else value >= bound
            verdict = f"target {op} {bound:<5} {'met' if ok else 'n/a' if math.isnan(value) else 'MISSED'}"
        print(f"  {name:<50}{value:8.3f}   {verdict}")
    if math.isnan(s["ratios"]["overhead datastates / dcp"]):
        print("  (overhead: DCP's median slowdown is <= 1 here, no overhead to compare with; noise, or rerun longer)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: .venv/bin/python bench/dcp_fsdp.py --layers 2 --runs 2")
    ap.add_argument("--layers", type=int, default=12, help="transformer blocks (default 12: 42 M params, 0.5 GB with AdamW)")
    ap.add_argument("--dim", type=int, default=512, help="model width (default 512)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (default 4096)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank and step (default 1)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps (default 5: about 6 s apart at the "
                    "default size, each checkpoint durable well before the next)")
    ap.add_argument("--runs", type=int, default=3, help="rounds of every contender, interleaved (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the first run (default 2)")
    ap.add_argument("--dcp-config", choices=CONFIGS, default="auto",
                    help="DCP's async_save executor + stager; auto: the lowest slowdown in short loops of each (default)")
    ap.add_argument("--probe-steps", type=int, default=20, help="auto: timed steps of each short loop (default 20)")
    ap.add_argument("--probe-rounds", type=int, default=2, help="auto: rounds of the short loops, each configuration's "
                    "slowdown against no checkpoint in the same round, median (default 2)")
    ap.add_argument("--raw-threads", type=int, default=2, help="threads of the raw O_DIRECT write (default 2, as compare.py)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the training and load phases (default 2)")
    ap.add_argument("--root", default="/var/tmp/datastates-dcp-bench", help="checkpoints, on the disk under test "
                    "(not tmpfs); emptied first and removed after")
    ap.add_argument("--out", default=os.path.join(RESULTS, "dcp_fsdp.json"))
    args = ap.parse_args()
    if args.steps < args.every or args.every < 1 or args.runs < 1:
        ap.error("need --every >= 1, --steps >= --every and --runs >= 1")

    model = {"layers": args.layers, "dim": args.dim, "vocab": args.vocab, "seq": args.seq, "batch": args.batch}
    n_params = params_of(args.layers, args.dim, args.vocab, args.seq)
    nbytes = 3 * 4 * n_params
    print(f"model: GPT {args.layers} x {args.dim}, vocab {args.vocab}, {n_params / 1e6:.1f} M params; checkpoint "
          f"(model + AdamW) {nbytes / 1e9:.2f} GB over {args.nproc} ranks (FSDP2, gloo, CPU); {args.steps} steps, "
          f"a checkpoint every {args.every}; {args.runs} runs", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    root = os.path.realpath(args.root)
    # the daemon keeps a replica and a spare per rank file of a run folder: the training, load and 4-rank folders
    # hold 5 checkpoints' worth, over the default budget (2 GiB) at the default size
    config = {"memory_restore_budget": max(2 << 30, 6 * nbytes)}
    log_path = os.path.splitext(args.out)[0] + ".log"
    t_start = time.perf_counter()
    with open(log_path, "w") as log, datastatesd(root, **config) as endpoint:
        wait_pool_mapped(endpoint)
        common = {"root": root, "model": model, "runs": args.runs}
        printer = RunPrinter(args.nproc)
        print("train" + (": pre-measuring DCP's configurations" if args.dcp_config == "auto" else ""), flush=True)
        train = torchrun("train", args.nproc, common | {"steps": args.steps, "every": args.every, "warmup": args.warmup,
                                                        "dcp_config": args.dcp_config, "probe_steps": args.probe_steps,
                                                        "probe_rounds": args.probe_rounds},
                         endpoint, log, printer)
        chosen = next(r for r in train if r["kind"] == "dcp_config" and r["rank"] == 0)
        dcp_config = chosen["config"]
        print("save4: the 4-rank checkpoint", flush=True)
        folder4 = os.path.join(root, "ds4", "w4")
        torchrun("save4", 4, common | {"folder": folder4}, endpoint, log)
        print("load", flush=True)
        loads = torchrun("load", args.nproc, common | {"dcp_config": dcp_config, "raw_threads": args.raw_threads,
                                                       "folder4": folder4}, endpoint, log, printer)
    shutil.rmtree(root, ignore_errors=True)
    summary = summarize([r for r in train if r["kind"] == "train"], [r for r in loads if r["kind"] == "load"])
    print(f"\ndcp configuration: {dcp_config} (async_save executor + reused DefaultStager; "
          f"{'the lowest slowdown of the pre-measurement' if args.dcp_config == 'auto' else 'as --dcp-config said'})")
    print_summary(summary, args.runs)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args) | {"n_params": n_params, "ckpt_bytes": nbytes, "dcp_config": dcp_config,
                                   "dcp_config_slowdowns": chosen["slowdowns"]},
                   "summary": summary, "results": train + loads}, f, indent=1)
    print(f"\nwrote {os.path.relpath(args.out)} (ranks' stderr: {os.path.relpath(log_path)}); "
          f"{time.perf_counter() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
