"""How much checkpointing slows a training loop: datastates vs DCP ``async_save``, on the CPU.

Why: what matters to a trainer is the step time, not the checkpoint's write speed. A
checkpoint that is "async" still costs the loop something: the capture or staging call,
the fence before the optimizer step, and the CPU, memory bandwidth and GIL its background
work takes away from forward, backward and the optimizer. This trains a small MLP (a few
Linear layers, fused AdamW) for a fixed number of steps and checkpoints model + optimizer every
``--every`` steps, three ways measured in one run, interleaved run by run:

- ``none``: no checkpointing, the baseline;
- ``datastates``: ``client.protect(opt)`` once, then ``snapshot()`` + ``commit()`` every N
  steps; the commit futures are resolved after the timed loop (the "drain");
- ``dcp``: ``torch.distributed.checkpoint.async_save`` in thread mode, single process
  (``no_dist``), with a reused ``DefaultStager`` staging asynchronously into shared memory.
  Its staging future is resolved right before the next ``opt.step()`` (the same place as
  datastates' fence), because DCP reads the live tensors until staging completes; the
  previous save's upload future is resolved before the next ``async_save``, as DCP's
  tutorial does, because the reused stager overwrites its staging buffers.

It reports, per mode, the median over ``--runs`` of the mean step time (checkpoint steps
included), the slowdown against ``none`` of the same run, and the datastates/DCP ratios.
Absolute times drift on this machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import (
    AsyncCheckpointerType,
    AsyncSaveResponse,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import datastatesd, median, state_bytes, wait_pool_mapped
from datastates.client import Client
from datastates.client.locate import latest

MODES = ("none", "datastates", "dcp")
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is what we want

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "train_overhead.json")


@dataclass
class RunResult:
    """One timed loop of one mode."""

    mode: str
    run: int
    step_s: list[float]
    save_calls_s: list[float] = field(default_factory=list)  # each checkpoint's in-loop call
    checkpoints: int = 0
    ckpt_bytes: int = 0
    save_call_s: float = 0.0  # inside the loop: snapshot+commit, or async_save (incl. waiting for the previous upload)
    wait_prev_s: float = 0.0  # dcp only: part of save_call_s spent waiting for the previous upload
    fence_s: float = 0.0  # inside the loop: the wait before opt.step()
    drain_s: float = 0.0  # after the loop: until every checkpoint is durable

    @property
    def mean_step_s(self) -> float:
        return sum(self.step_s) / len(self.step_s)


@dataclass
class Setup:
    model: nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor
    n_params: int = field(init=False)

    def __post_init__(self) -> None:
        self.n_params = sum(p.numel() for p in self.model.parameters())


def build(params_m: float, layers: int, batch: int, seed: int = 0) -> Setup:
    """A ``layers``-deep MLP of square Linear layers with about ``params_m`` million parameters."""
    dim = max(64, round(math.sqrt(params_m * 1e6 / layers) / 64) * 64)
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(dim, dim))
        if i < layers - 1:
            mods.append(nn.ReLU())
    model = nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # fused: ~3x faster than foreach on the CPU
    return Setup(model, opt, torch.randn(batch, dim), torch.randn(batch, dim))


def state_of(s: Setup, step: int) -> dict[str, Any]:
    return {"model": s.model.state_dict(), "optimizer": s.opt.state_dict(), "step": step}


def step_once(s: Setup) -> None:
    loss = F.mse_loss(s.model(s.x), s.y)
    loss.backward()
    s.opt.step()  # the pre-hooks (datastates' protect, the DCP fence) run here
    s.opt.zero_grad(set_to_none=True)


def timed_fence(opt: torch.optim.Optimizer, acc: RunResult, register: Callable[[], Any]) -> list[Any]:
    """Wrap the fence hook(s) ``register`` installs with timing hooks (pre-hooks run in order)."""
    t0 = [0.0]

    def start(*_: Any) -> None:
        t0[0] = time.perf_counter()

    def stop(*_: Any) -> None:
        acc.fence_s += time.perf_counter() - t0[0]

    handles = [opt.register_step_pre_hook(start)]
    handles.append(register())
    handles.append(opt.register_step_pre_hook(stop))
    return handles


def loop(s: Setup, steps: int, every: int, acc: RunResult, checkpoint: Callable[[int], None] | None) -> None:
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        step_once(s)
        if checkpoint is not None and step % every == 0:
            t1 = time.perf_counter()
            checkpoint(step)
            acc.save_calls_s.append(time.perf_counter() - t1)
            acc.save_call_s += acc.save_calls_s[-1]
            acc.checkpoints += 1
        acc.step_s.append(time.perf_counter() - t0)


def run_none(s: Setup, args: argparse.Namespace, run: int, _: str) -> RunResult:
    acc = RunResult("none", run, [])
    loop(s, args.steps, args.every, acc, None)
    return acc


def run_datastates(s: Setup, args: argparse.Namespace, run: int, folder: str, endpoint: str) -> RunResult:
    acc = RunResult("datastates", run, [])
    futures: list[Future] = []
    last_tag = None
    with Client(endpoint) as client:
        handles = timed_fence(s.opt, acc, lambda: client.protect(s.opt))

        def checkpoint(step: int) -> None:
            nonlocal last_tag
            tag = f"global_step{step}"
            h = client.snapshot(state_of(s, step), os.path.join(folder, tag, "model_states.pt"), tag)
            acc.ckpt_bytes = h.nbytes
            futures.append(client.commit(tag))
            last_tag = tag

        loop(s, args.steps, args.every, acc, checkpoint)
        t0 = time.perf_counter()
        client.wait()  # the last snapshot has no opt.step() after it to fence it
        for fut in futures:
            fut.result()
        acc.drain_s = time.perf_counter() - t0
        for h in handles:
            h.remove()
    if last_tag is not None and latest(folder) != last_tag:
        raise RuntimeError(f"datastates: newest committed tag is {latest(folder)!r}, expected {last_tag!r}")
    return acc


def make_stager(use_default: bool) -> Any:
    """A ``DefaultStager`` staging asynchronously into shared memory (no pinning, no CUDA), or None."""
    if use_default:
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # (use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy)
    return DefaultStager(StagingOptions(False, True, True, False))


def probe_stager() -> bool:
    """True if the async shared-memory stager works here; else print a note and use DCP's default."""
    folder = tempfile.mkdtemp(prefix="dcp-probe-", dir="/tmp")
    stager = None
    try:
        stager = make_stager(False)
        resp = dcp.async_save({"t": torch.arange(8.0)}, checkpoint_id=folder,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager, no_dist=True)
        if isinstance(resp, AsyncSaveResponse):
            resp.staging_completion.result()
            resp.upload_completion.result()
        else:
            resp.result()
        return False
    except Exception as exc:  # noqa: BLE001 - any failure means: fall back
        print(f"note: DefaultStager(StagingOptions(False, True, True, False)) failed ({type(exc).__name__}: {exc}); "
              "using async_save's default stager (synchronous staging inside async_save)")
        return True
    finally:
        if stager is not None:
            stager.close()
        shutil.rmtree(folder, ignore_errors=True)


def run_dcp(s: Setup, args: argparse.Namespace, run: int, folder: str) -> RunResult:
    acc = RunResult("dcp", run, [])
    stager = make_stager(args.dcp_default_stager)
    staging: Future | None = None  # resolved before the next opt.step(): DCP reads live tensors until then
    upload: Future | None = None  # resolved before the next async_save: the stager reuses its buffers

    def fence(*_: Any) -> None:
        nonlocal staging
        if staging is not None:
            staging.result()
            staging = None

    handles = timed_fence(s.opt, acc, lambda: s.opt.register_step_pre_hook(fence))

    def checkpoint(step: int) -> None:
        nonlocal staging, upload
        if upload is not None:
            t0 = time.perf_counter()
            upload.result()
            acc.wait_prev_s += time.perf_counter() - t0
        resp = dcp.async_save(state_of(s, step), checkpoint_id=os.path.join(folder, f"global_step{step}"),
                              async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=stager, no_dist=True)
        if isinstance(resp, AsyncSaveResponse):
            staging, upload = resp.staging_completion, resp.upload_completion
        else:  # staged synchronously inside async_save: nothing to fence
            staging, upload = None, resp

    acc.ckpt_bytes = state_bytes(state_of(s, 0))
    try:
        loop(s, args.steps, args.every, acc, checkpoint)
        t0 = time.perf_counter()
        fence()
        if upload is not None:
            upload.result()
        acc.drain_s = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
        if stager is not None:
            stager.close()
    if acc.checkpoints and not os.path.exists(os.path.join(folder, f"global_step{args.steps // args.every * args.every}", ".metadata")):
        raise RuntimeError("dcp: the last checkpoint has no .metadata")
    return acc


def one_run(mode: str, args: argparse.Namespace, run: int, root: str, endpoint: str | None) -> RunResult:
    """A fresh model and optimizer (so each run pays the same first-checkpoint costs), warm-up, loop."""
    s = build(args.params, args.layers, args.batch, seed=run)
    for _ in range(args.warmup):  # AdamW creates its state on the first step
        step_once(s)
    folder = tempfile.mkdtemp(prefix=f"{mode}-r{run}-", dir=root)
    try:
        if mode == "none":
            r = run_none(s, args, run, folder)
        elif mode == "datastates":
            assert endpoint is not None
            r = run_datastates(s, args, run, folder, endpoint)
        else:
            r = run_dcp(s, args, run, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        del s
        gc.collect()
    return r


def summarize(results: list[RunResult], modes: list[str]) -> dict[str, dict[str, Any]]:
    base = {r.run: r.mean_step_s for r in results if r.mode == "none"}
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        rs = [r for r in results if r.mode == mode]
        n = max(1, rs[0].checkpoints)
        out[mode] = {
            "runs": len(rs),
            "step_ms": 1e3 * median([r.mean_step_s for r in rs]),
            "slowdown": median([r.mean_step_s / base[r.run] for r in rs]) if base else None,
            "checkpoints": rs[0].checkpoints,
            "ckpt_gb": rs[0].ckpt_bytes / 1e9,
            "save_call_ms": 1e3 * median([r.save_call_s for r in rs]) / n,
            # the first one pays one-time costs: the reused DCP stager allocates its staging buffers (datastates
            # reads the trainer in place, so its first costs what the later ones do)
            "first_save_call_ms": 1e3 * median([r.save_calls_s[0] for r in rs]) if rs[0].save_calls_s else 0.0,
            "later_save_call_ms": 1e3 * median([median(r.save_calls_s[1:]) for r in rs]) if len(rs[0].save_calls_s) > 1 else 0.0,
            "wait_prev_ms": 1e3 * median([r.wait_prev_s for r in rs]) / n,
            "fence_ms": 1e3 * median([r.fence_s for r in rs]) / n,
            "drain_s": median([r.drain_s for r in rs]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: .venv/bin/python bench/train_overhead.py --steps 60 --every 10 --runs 3")
    ap.add_argument("--steps", type=int, default=60, help="timed training steps per run (default 60)")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps (default 10)")
    ap.add_argument("--runs", type=int, default=3, help="repeats of each mode, interleaved; medians reported (default 3)")
    ap.add_argument("--params", type=float, default=64, help="model size in millions of fp32 parameters (default 64: "
                    "a checkpoint with AdamW state of about 0.8 GB)")
    ap.add_argument("--layers", type=int, default=8, help="Linear layers; the width follows from --params (default 8)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (default 8: about 0.2 s a step on 2 cores at the default size)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each loop (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)} (default all)")
    ap.add_argument("--dcp-default-stager", action="store_true", help="give async_save no stager (its default, "
                    "synchronous staging) instead of the async shared-memory DefaultStager")
    ap.add_argument("--daemon", action="append", default=[], metavar="KEY=VALUE",
                    help="a node config key for the daemon, e.g. memory_restore=none (repeatable)")
    ap.add_argument("--root", default=None, help="folder for the checkpoints (default: a fresh temp dir under /tmp, "
                    "removed afterwards); each mode and run writes into a fresh subfolder, removed after the run")
    ap.add_argument("--out", default=RESULTS, help=f"JSON results (default {os.path.relpath(RESULTS)})")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {','.join(MODES)}")
    if args.steps < 1 or args.every < 1 or args.runs < 1:
        ap.error("--steps, --every and --runs must be >= 1")

    torch.set_num_threads(args.threads)
    if "dcp" in modes and not args.dcp_default_stager:
        args.dcp_default_stager = probe_stager()

    own_root = args.root is None
    root = os.path.realpath(tempfile.mkdtemp(prefix="ds-train-overhead-", dir="/tmp") if own_root else args.root)
    os.makedirs(root, exist_ok=True)
    probe = build(args.params, args.layers, args.batch)
    n_params, dim = probe.n_params, probe.x.shape[1]
    del probe
    print(f"model: {args.layers} x Linear({dim}, {dim}) = {n_params / 1e6:.1f} M params, batch {args.batch}; "
          f"checkpoint (params + AdamW state) ~{3 * n_params * 4 / 1e9:.2f} GB; "
          f"{args.steps} steps, checkpoint every {args.every}, {args.runs} run(s), {args.threads} threads")
    print(f"dcp stager: {'async_save default (sync staging)' if args.dcp_default_stager else 'DefaultStager(StagingOptions(False, True, True, False)), reused'}")

    results: list[RunResult] = []
    try:
        config = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in args.daemon)}
        with datastatesd(root, **config) if "datastates" in modes else nullcontext() as endpoint:
            if endpoint is not None:  # a fresh daemon prefaults its host pool: let it finish before timing anything
                t0 = time.perf_counter()
                wait_pool_mapped(endpoint)
                print(f"datastatesd: host pool mapped after {time.perf_counter() - t0:.1f} s")
            for run in range(args.runs):
                for mode in modes:
                    r = one_run(mode, args, run, root, endpoint)
                    results.append(r)
                    print(f"  run {run} {mode:<10} step {1e3 * r.mean_step_s:7.1f} ms  save-call {1e3 * r.save_call_s:7.1f} ms  "
                          f"fence {1e3 * r.fence_s:7.1f} ms  drain {r.drain_s:6.2f} s", flush=True)
    finally:
        if own_root:
            shutil.rmtree(root, ignore_errors=True)

    summary = summarize(results, modes)
    print()
    print(f"{'mode':<11}{'step ms':>9}{'slowdown':>10}{'ckpts':>7}{'save-call ms/ckpt':>19}{'first':>8}{'later':>8}"
          f"{'fence ms/ckpt':>15}{'drain s':>9}")
    for mode, v in summary.items():
        sd = f"{v['slowdown']:.3f}" if v["slowdown"] is not None else "-"
        print(f"{mode:<11}{v['step_ms']:9.1f}{sd:>10}{v['checkpoints']:7d}{v['save_call_ms']:19.1f}{v['first_save_call_ms']:8.1f}"
              f"{v['later_save_call_ms']:8.1f}{v['fence_ms']:15.1f}{v['drain_s']:9.2f}")
    if "dcp" in summary and summary["dcp"]["wait_prev_ms"]:
        print(f"(dcp save-call includes {summary['dcp']['wait_prev_ms']:.1f} ms/ckpt waiting for the previous upload)")
    ratios: dict[str, float] = {}
    if {"none", "datastates", "dcp"} <= summary.keys():
        ds, dc = summary["datastates"]["slowdown"], summary["dcp"]["slowdown"]
        ratios["slowdown_datastates_over_dcp"] = ds / dc
        if dc - 1 > 1e-9:
            ratios["overhead_datastates_over_dcp"] = (ds - 1) / (dc - 1)
        ratios["drain_datastates_over_dcp"] = summary["datastates"]["drain_s"] / max(summary["dcp"]["drain_s"], 1e-9)
        print(f"\nslowdown  datastates / dcp async_save: {ratios['slowdown_datastates_over_dcp']:.3f}")
        if "overhead_datastates_over_dcp" in ratios:
            print(f"overhead  (slowdown - 1) datastates / dcp: {ratios['overhead_datastates_over_dcp']:.3f}")
        print(f"drain     datastates / dcp: {ratios['drain_datastates_over_dcp']:.3f}")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "config": {k: v for k, v in vars(args).items() if k != "out"} | {"n_params": n_params, "dim": dim,
                                                                             "torch": torch.__version__},
            "summary": summary,
            "ratios": ratios,
            "runs": [asdict(r) | {"mean_step_s": r.mean_step_s} for r in results],
        }, f, indent=2)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
