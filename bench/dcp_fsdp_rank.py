"""The rank side of bench/dcp_fsdp.py: one torchrun rank (gloo, CPU), FSDP2 over every rank (the model:
bench/dcp_fsdp_model.py).

``torchrun ... bench/dcp_fsdp_rank.py PHASE ARGS_JSON``; each rank prints ``RESULT {...}`` lines
(one JSON object each) for the parent to collect. The phases:

- ``train``: one model and AdamW for the whole phase; optionally a short pre-measurement of
  DCP's async_save configurations first (short loops of each and of no checkpoint, interleaved;
  the lowest slowdown on rank 0 picked and broadcast); a warm-up
  checkpoint per contender; then ``runs`` rounds of the contenders, interleaved, each a timed loop
  of ``steps`` steps with a checkpoint every ``every``. After each checkpointing run, one key of its
  last checkpoint is loaded back and compared with the value it had when saved.
- ``save4``: (4 ranks) the model saved once through datastates, for the reshard load; rank 0
  keeps one full tensor of it (``ref4.pt``) to check the load against.
- ``load``: per run, a raw O_DIRECT write (rank 0), a datastates and a DCP save (in an order that flips each run; durable
  times, nothing else running), then cold loads into another FSDP model and optimizer:
  DCP's ``FileSystemReader``, ``DatastatesStorageReader()``, ``DatastatesStorageReader(client)``
  (the daemon's memory), and the 4-rank checkpoint (4 → 2), every load checked.

Garbage is collected as torchtitan collects it (its ``GarbageCollection``): automatic collection
off, generations 0 and 1 collected every GC_EVERY training steps and before each timed save or
load. A full collection of a rank's 300,000 objects (torch's own, mostly) takes 0.13-0.19 s
here; left automatic, one fell into most timed DCP plannings, of either contender.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import drop_caches, fsync_tree, raw_write  # noqa: E402
from dcp_fsdp_model import Trainer, build, local_bytes, local_tensors, unequal  # noqa: E402

from datastates.client import Client  # noqa: E402
from datastates.integrations.dcp import DatastatesStorageReader, DatastatesStorageWriter  # noqa: E402

GC_EVERY = 50
"""torchtitan's default ``gc_freq``."""

DCP_CONFIGS: dict[str, tuple[AsyncCheckpointerType, StagingOptions]] = {
    # StagingOptions(use_pinned_memory, use_shared_memory, use_async_staging, use_non_blocking_copy); a
    # non-blocking copy needs an accelerator, and pinning without CUDA is ignored by DCP (with a warning)
    "thread+shm": (AsyncCheckpointerType.THREAD, StagingOptions(False, True, True, False)),
    "thread+private": (AsyncCheckpointerType.THREAD, StagingOptions(False, False, True, False)),
    "thread+pinned": (AsyncCheckpointerType.THREAD, StagingOptions(True, False, True, False)),
    "process+shm": (AsyncCheckpointerType.PROCESS, StagingOptions(False, True, True, False)),
    "process+pinned": (AsyncCheckpointerType.PROCESS, StagingOptions(True, True, True, False)),
}
"""DCP's async_save configurations tried: the executor, and a reused ``DefaultStager``'s options."""


CHECK_KEY = "blocks.0.fc.weight"
"""The model key every contender's last checkpoint is checked by: loaded alone, compared with its saved value."""


def check_one_key(folder: str, reader: Any, expected: torch.Tensor, t: Trainer) -> bool:
    probe = {"model": {CHECK_KEY: torch.zeros_like(t.state()["model"][CHECK_KEY])}}
    dcp.load(probe, checkpoint_id=folder, storage_reader=reader)
    return bool(torch.equal(probe["model"][CHECK_KEY].to_local(), expected))


def emit(kind: str, **fields: Any) -> None:
    """One result line on stdout, in one write: the ranks share the pipe, and a write of under PIPE_BUF bytes is
    never interleaved with another."""
    line = "RESULT " + json.dumps({"kind": kind, "rank": dist.get_rank(), **fields}, default=str) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


# -- the contenders of the training phase ------------------------------------------------------


@dataclass
class RunStats:
    """One timed loop of one contender on this rank."""

    contender: str
    run: int
    step_s: list[float] = field(default_factory=list)
    state_dict_s: float = 0.0
    """get_state_dict at the checkpoints (the same for every contender; not in ``blocked``)."""
    save_call_s: float = 0.0
    """In the async_save calls (DCP: staging too where it is synchronous)."""
    wait_prev_s: float = 0.0
    """Before an async_save, waiting for the previous checkpoint (none should be pending, checkpoints far apart)."""
    fence_s: float = 0.0
    """In the optimizer step's pre-hook: datastates' fence, DCP's wait for staging."""
    drain_s: float = 0.0
    """After the loop, until the last checkpoint is durable."""
    durable_s: list[float] = field(default_factory=list)
    """Per checkpoint, from the async_save call to its future resolved."""
    checkpoints: int = 0
    ckpt_bytes: int = 0
    check_ok: bool | None = None


class Contender:
    """One way to checkpoint in the loop: ``fence`` (its hook, installed per loop), ``checkpoint`` every N steps,
    ``drain`` after the loop, ``reader`` for the check, ``close`` once."""

    name = ""

    def __init__(self, t: Trainer, group: dist.ProcessGroup, root: str) -> None:
        self.t, self.group, self.root = t, group, root
        self.pending: Future | None = None
        self.stats = RunStats("", 0)
        self.last: tuple[str, torch.Tensor] | None = None
        """The newest checkpoint's folder and the check key's local shard as saved."""

    def fence(self) -> Any:
        """Install the fence hook; returns its handle (or None)."""
        return None

    def save(self, state: dict[str, Any], folder: str) -> Future:
        raise NotImplementedError

    def reader(self) -> Any:
        raise NotImplementedError

    def checkpoint(self, folder: str) -> None:
        s = self.stats
        t0 = time.perf_counter()
        if self.pending is not None:
            self.pending.result()
        t1 = time.perf_counter()
        state = self.t.state()
        t2 = time.perf_counter()
        fut = self.save(state, folder)
        t3 = time.perf_counter()
        fut.add_done_callback(lambda _f, t2=t2: s.durable_s.append(time.perf_counter() - t2))  # runs as it resolves
        s.wait_prev_s += t1 - t0
        s.state_dict_s += t2 - t1
        s.save_call_s += t3 - t2
        s.checkpoints += 1
        s.ckpt_bytes = local_bytes(state)
        self.pending = fut
        self.last = folder, state["model"][CHECK_KEY].to_local().clone()  # after the call: not timed

    def drain(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        pass


class DcpAsync(Contender):
    """DCP's own ``async_save`` with ``FileSystemWriter``, a reused ``DefaultStager``; its staging future is resolved
    right before the next optimizer step (DCP reads the live tensors until then)."""

    def __init__(self, t: Trainer, group: dist.ProcessGroup, root: str, config: str) -> None:
        super().__init__(t, group, root)
        self.name = f"dcp {config}"
        self.kind, options = DCP_CONFIGS[config]
        self.stager = DefaultStager(options)
        self.staging: Future | None = None

    def fence(self) -> Any:
        def wait_staged(*_: Any) -> None:
            if self.staging is not None:
                self.staging.result()
                self.staging = None

        return self.t.opt.register_step_pre_hook(wait_staged)

    def save(self, state: dict[str, Any], folder: str) -> Future:
        out = dcp.async_save(state, checkpoint_id=folder, storage_writer=dcp.FileSystemWriter(folder),
                             process_group=self.group, async_checkpointer_type=self.kind, async_stager=self.stager)
        if isinstance(out, AsyncSaveResponse):
            self.staging = out.staging_completion
            return out.upload_completion
        return out

    def drain(self) -> None:
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        super().drain()

    def reader(self) -> Any:
        return dcp.FileSystemReader(self.last[0]) if self.last else None

    def close(self) -> None:
        self.stager.close()


class Datastates(Contender):
    """``dcp.async_save`` through ``DatastatesStorageWriter``; ``client.protect(opt)`` is the fence."""

    name = "datastates"

    def __init__(self, t: Trainer, group: dist.ProcessGroup, root: str, client: Client) -> None:
        super().__init__(t, group, root)
        self.client = client

    def fence(self) -> Any:
        return self.client.protect(self.t.opt)

    def save(self, state: dict[str, Any], folder: str) -> Future:
        return dcp.async_save(state, checkpoint_id=folder, storage_writer=DatastatesStorageWriter(self.client),
                              process_group=self.group)

    def drain(self) -> None:
        self.client.wait()  # the last snapshot has no optimizer step after it to fence it
        super().drain()

    def reader(self) -> Any:
        return DatastatesStorageReader()


class NoCheckpoint(Contender):
    name = "none"


def timed_loop(c: Contender, run: int, steps: int, every: int, folder: str, prefix: str = "") -> RunStats:
    """``steps`` training steps, a checkpoint every ``every`` into ``folder``/<prefix>step<N>; the fence hook timed by
    two pre-hooks around it (pre-hooks run in the order they were registered)."""
    c.stats = stats = RunStats(c.name, run)
    t0 = [0.0]

    def start(*_: Any) -> None:
        t0[0] = time.perf_counter()

    def stop(*_: Any) -> None:
        stats.fence_s += time.perf_counter() - t0[0]

    handles = [c.t.opt.register_step_pre_hook(start), c.fence(), c.t.opt.register_step_pre_hook(stop)]
    try:
        gc.collect(1)
        dist.barrier()
        for i in range(1, steps + 1):
            s0 = time.perf_counter()
            if i % GC_EVERY == 0:
                gc.collect(1)
            c.t.train_step()
            if not isinstance(c, NoCheckpoint) and i % every == 0:
                c.checkpoint(os.path.join(folder, f"{prefix}step{c.t.step}"))
            stats.step_s.append(time.perf_counter() - s0)
        d0 = time.perf_counter()
        c.drain()
        stats.drain_s = time.perf_counter() - d0
    finally:
        for h in handles:
            if h is not None:
                h.remove()
    if c.last is not None:
        stats.check_ok = check_one_key(c.last[0], c.reader(), c.last[1], c.t)
    return stats


def clear(folder: str) -> None:
    """Every rank done with ``folder``, rank 0 removes it (the disk fills up otherwise)."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def pick_dcp_config(t: Trainer, group: dist.ProcessGroup, root: str, configs: list[str], steps: int, every: int,
                    rounds: int) -> tuple[str, dict[str, float]]:
    """Short loops of each configuration and of no checkpoint, interleaved over ``rounds`` (after a warm-up
    checkpoint each); the lowest median slowdown on rank 0 wins. A configuration that fails is reported and left out."""
    contenders: list[Contender] = [NoCheckpoint(t, group, root)]
    for name in configs:
        c = DcpAsync(t, group, root, name)
        try:
            timed_loop(c, -1, every, every, os.path.join(root, "probe-warmup", name))  # buffers, a process: once
            contenders.append(c)
        except Exception as exc:  # noqa: BLE001 - a configuration this torch cannot run is reported, not fatal
            emit("probe", config=name, run=0, error=f"{type(exc).__name__}: {exc}"[:500])
            c.close()
    slowdowns: dict[str, list[float]] = defaultdict(list)
    for run in range(rounds):
        means: dict[str, float] = {}
        for c in contenders if run % 2 == 0 else contenders[::-1]:
            folder = os.path.join(root, "probe", c.name.replace(" ", "-"), str(run))
            s = timed_loop(c, run, steps, every, folder)
            clear(folder)
            means[c.name] = sum(s.step_s) / len(s.step_s)
            emit("probe", config=c.name, **asdict(s))
        for name, mean in means.items():
            slowdowns[name].append(mean / means["none"])
    for c in contenders:
        c.close()
    scores = {c.name.removeprefix("dcp "): statistics.median(slowdowns[c.name]) for c in contenders[1:]}
    best = [min(scores, key=scores.__getitem__) if scores else ""]
    dist.broadcast_object_list(best, src=0)
    if not best[0]:
        raise RuntimeError("no DCP async_save configuration ran")
    return best[0], scores


def train_phase(args: dict[str, Any]) -> None:
    root = args["root"]
    t = build(args["model"], seed=0, steps=args["warmup"])
    group = dist.new_group(backend="gloo")  # DCP's save thread gathers on its own group, never beside training's
    config, scores = args["dcp_config"], {}
    if config == "auto":  # pinning without CUDA is ignored by DCP: the same as private memory, so not tried
        tried = [c for c in DCP_CONFIGS if "pinned" not in c or torch.cuda.is_available()]
        config, scores = pick_dcp_config(t, group, root, tried, args["probe_steps"], args["every"], args["probe_rounds"])
    emit("dcp_config", config=config, slowdowns=scores)
    with Client(timeout=300) as client:
        contenders: list[Contender] = [NoCheckpoint(t, group, root), DcpAsync(t, group, root, config),
                                       Datastates(t, group, root, client)]
        for c in contenders[1:]:  # one-time costs (the stager's buffers, a process, the daemon's regions) untimed
            timed_loop(c, -1, args["every"], args["every"], os.path.join(root, "train", c.name.replace(" ", "-")),
                       "warmup-")
        for run in range(args["runs"]):
            order = contenders if run % 2 == 0 else contenders[::-1]
            for c in order:
                # one run folder per contender, the tags named by run and step: the daemon keeps one replica (and a
                # spare) per rank file of a run folder, so a folder per run would hold one each, to the end
                folder = os.path.join(root, "train", c.name.replace(" ", "-"))
                emit("train", **asdict(timed_loop(c, run, args["steps"], args["every"], folder, f"r{run}-")))
                clear(folder)
        for c in contenders:
            c.close()


# -- save4 and load --------------------------------------------------------------------------


def ref_tensor(t: Trainer) -> torch.Tensor:
    """The check key's whole tensor, gathered from every rank (a collective)."""
    return t.state()["model"][CHECK_KEY].full_tensor()


def save4_phase(args: dict[str, Any]) -> None:
    t = build(args["model"], seed=4, steps=2)
    with Client(timeout=300) as client:
        dcp.save(t.state(), checkpoint_id=args["folder"], storage_writer=DatastatesStorageWriter(client))
    full = ref_tensor(t)
    if dist.get_rank() == 0:
        torch.save(full, os.path.join(args["root"], "ref4.pt"))
    emit("save4", bytes=local_bytes(t.state()))


def timed_across(fn: Callable[[], Any]) -> float:
    """``fn`` started together on every rank; the time until the last rank is done (a barrier after)."""
    gc.collect(1)
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def cold(*folders: str) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        drop_caches(*folders)
    dist.barrier()


def timed_method(obj: Any, name: str) -> list[float]:
    """Time each call of ``obj.name`` into the list returned: [seconds in it, when it was first entered]. For a
    reader's ``read_metadata`` (the coordinator's part of a load: DCP broadcasts what it returns) and ``read_data``
    (the storage layer's whole part of a load), and a writer's ``write_data`` (everything of a save from it on is
    the storage layer's: DCP's planning comes before it)."""
    spent = [0.0, 0.0]
    call = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        spent[1] = spent[1] or t0
        try:
            return call(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    setattr(obj, name, timed)
    return spent


def max_across(value: float) -> float:
    """The largest of every rank's ``value``: the slowest rank's."""
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def load_phase(args: dict[str, Any]) -> None:
    root = args["root"]
    src = build(args["model"], seed=2, steps=2)
    dst = build(args["model"], seed=3, steps=1)
    group = dist.new_group(backend="gloo")
    kind, options = DCP_CONFIGS[args["dcp_config"]]
    stager = DefaultStager(options)
    ref4 = torch.load(os.path.join(root, "ref4.pt"))
    sources: list[str] = []
    with Client(timeout=300) as client:
        restore = client.restore_with

        def restore_noted(*a: Any, **kw: Any) -> Any:
            out = restore(*a, **kw)
            sources.append("none" if out is None else out.source if out.source == "memory"
                           else f"{out.source} ({out.why_not_memory})")
            return out

        client.restore_with = restore_noted  # type: ignore[method-assign]  # which source the memory load took
        state = src.state()
        # one untimed save each first: the stager's buffers, DCP's checkpoint process, the daemon's first regions
        dcp.async_save(state, checkpoint_id=os.path.join(root, "ds2", "warmup"), storage_writer=DatastatesStorageWriter(client),
                       process_group=group).result()
        res = dcp.async_save(state, checkpoint_id=os.path.join(root, "fs2", "warmup"), process_group=group,
                             storage_writer=dcp.FileSystemWriter(os.path.join(root, "fs2", "warmup")),
                             async_checkpointer_type=kind, async_stager=stager)
        (res.upload_completion if isinstance(res, AsyncSaveResponse) else res).result()
        for run in range(args["runs"]):
            nbytes = torch.tensor([local_bytes(state)])
            dist.all_reduce(nbytes)
            out: dict[str, Any] = {"run": run, "bytes": int(nbytes.item())}
            raw = torch.zeros(1)
            if dist.get_rank() == 0:
                raw[0] = raw_write(os.path.join(root, f"raw-{run}.bin"), out["bytes"], args["raw_threads"])
            dist.broadcast(raw, 0)
            out["raw_write_s"] = float(raw.item())
            ds_folder = os.path.join(root, "ds2", f"load{run}")  # one run folder: each save supersedes the replica
            fs_folder = os.path.join(root, "fs2", f"load{run}")

            planned: dict[str, float] = {}

            def save(name: str, folder: str) -> Callable[[], None]:
                """One durable save; ``planned[name]``: seconds from the call until the writer's ``write_data``,
                DCP's own planning (its collectives among them), the same for every storage layer."""
                def run() -> None:
                    t0 = time.perf_counter()
                    if name == "ds":
                        writer = DatastatesStorageWriter(client)
                        first = timed_method(writer, "write_data")
                        dcp.async_save(state, checkpoint_id=folder, storage_writer=writer, process_group=group).result()
                    else:
                        writer = dcp.FileSystemWriter(folder)
                        first = timed_method(writer, "write_data") if kind == AsyncCheckpointerType.THREAD else [0.0, 0.0]
                        res = dcp.async_save(state, checkpoint_id=folder, storage_writer=writer, process_group=group,
                                             async_checkpointer_type=kind, async_stager=stager)
                        (res.upload_completion if isinstance(res, AsyncSaveResponse) else res).result()
                    planned[name] = first[1] - t0 if first[1] else math.nan  # process mode: timed in its process
                return run

            for name in ("fs", "ds") if run % 2 == 0 else ("ds", "fs"):  # the order flips each run, as in training
                contender = "dcp" if name == "fs" else "ds"
                out[f"durable_{contender}_s"] = timed_across(save(name, fs_folder if name == "fs" else ds_folder))
                out[f"planned_{contender}_s"] = max_across(planned[name])
            if dist.get_rank() == 0:
                fsync_tree(fs_folder)  # DCP's writer fsyncs its files; its folder entries too, to be alike

            checks: dict[str, Any] = {}
            for name, folder, reader in (("fs", fs_folder, dcp.FileSystemReader(fs_folder)),
                                         ("ds", ds_folder, DatastatesStorageReader()),
                                         ("memory", ds_folder, DatastatesStorageReader(client)),
                                         ("reshard", args["folder4"], DatastatesStorageReader())):
                target = dst.state()
                for tensor in local_tensors(target).values():  # nothing of the previous load left to pass a check
                    tensor.zero_()
                if name != "memory":
                    cold(folder)
                sources.clear()
                spent, reading = timed_method(reader, "read_metadata"), timed_method(reader, "read_data")
                out[f"load_{name}_s"] = timed_across(
                    lambda: dcp.load(target, checkpoint_id=folder, storage_reader=reader))  # noqa: B023 - called here
                out[f"metadata_{name}_s"] = spent[0]
                out[f"read_{name}_s"] = max_across(reading[0])
                if name == "memory":
                    out["memory_sources"] = sorted(set(sources))
                set_state_dict(dst.model, dst.opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
                if name == "reshard":
                    checks[name] = bool(torch.equal(ref_tensor(dst), ref4))
                else:
                    checks[name] = unequal(dst.state(), state)[:4] or True
                del target
            out["checks"] = checks
            emit("load", **out)
            clear(fs_folder)
    stager.close()


def main() -> None:
    phase, args = sys.argv[1], json.loads(sys.argv[2])
    torch.set_num_threads(1)
    gc.disable()
    gc.collect(1)
    dist.init_process_group("gloo")
    try:
        {"train": train_phase, "save4": save4_phase, "load": load_phase}[phase](args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
