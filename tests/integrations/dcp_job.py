"""An FSDP2 (and FSDP x TP) job for torchrun on gloo, CPU: DCP saves through datastates, loads with resharding.

Usage: torchrun ... dcp_job.py ROOT save|load [CASE...]. Every rank reaches its node's daemon through
$DATASTATES_ENDPOINT; each prints one JSON line (``RESULT {...}``) for the test to read.

- ``save``: 4 ranks. For each case, ``fsdp`` (FSDP2 over 4 ranks) and ``2d`` (FSDP 2 x TP 2),
  trains two steps, then saves the model and AdamW state (``get_state_dict``) twice at
  once: DCP's own ``FileSystemWriter`` into ``ROOT/ref-<case>`` (the reference), and
  ``dcp.async_save`` through ``DatastatesStorageWriter`` into ``ROOT/<case>-step2``; then
  at once takes an optimizer step with the gradients it still has (the fence must hold it
  until the daemon copied the shards), waits for the save and saves the next state with
  the synchronous ``dcp.save`` into ``ROOT/<case>-step3``.
- ``load``: any number of ranks, FSDP2 over all of them. For each case, a fresh model and
  optimizer of another seed load ``ROOT/<case>-step2`` through ``DatastatesStorageReader``,
  and another pair the reference through ``FileSystemReader``; every local shard must be
  equal. Then the model alone, and one key of it alone, the same way.
  Last, a save of ``ROOT/fsdp-killed`` that rank 1 does not survive: it SIGKILLs itself once
  its shards reached the daemon, before the coordinator commits (torchrun then stops the rest).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from datastates.client import Client
from datastates.integrations.dcp import DatastatesStorageReader, DatastatesStorageWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the DCP bench's shard helpers
from dcp_fsdp_model import local_tensors  # noqa: E402
from dcp_fsdp_model import unequal as every_unequal  # noqa: E402


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 64)
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(MLP() for _ in range(2))
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def build(case: str, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded as ``case`` says over every rank, and its AdamW; weights from ``seed``."""
    torch.manual_seed(seed)
    model = Model()
    world = dist.get_world_size()
    if case == "2d":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        shard_mesh = mesh["dp"]
    else:
        shard_mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))  # the same batch on every rank
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def unequal(a: Any, b: Any) -> list[str]:
    """The paths whose tensors differ (or that one side lacks), the first 20: names, never a tensor's values."""
    return every_unequal(a, b)[:20]


def say(result: dict[str, Any]) -> None:
    """One line for the test, in one write: the ranks share torchrun's stdout, and a pipe keeps such a write whole."""
    os.write(1, f"RESULT {json.dumps(result)}\n".encode())


def save(root: Path, client: Client) -> dict[str, Any]:
    out: dict[str, Any] = {}
    group = dist.new_group(backend="gloo")  # DCP's save thread gathers on its own group, never beside training's
    for case in ("fsdp", "2d"):
        model, opt = build(case, seed=0)
        client.protect(opt)
        for step in (1, 2):
            train_step(model, opt, step)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(99))
        model(x).square().mean().backward()  # gradients for the step right after the save
        state = state_of(model, opt)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(root / f"ref-{case}")))
        fut = dcp.async_save(state, checkpoint_id=str(root / f"{case}-step2"),
                             storage_writer=DatastatesStorageWriter(client), process_group=group)
        opt.step()  # at once: the fence holds it until the daemon copied the shards async_save handed it
        opt.zero_grad()
        fut.result(timeout=240)
        dcp.save(state_of(model, opt), checkpoint_id=str(root / f"{case}-step3"),
                 storage_writer=DatastatesStorageWriter(client))
        out[case] = "saved"
    say({"rank": dist.get_rank(), **out})
    killed(root, client)
    return out


def load_case(root: Path, case: str, tag: str) -> dict[str, Any]:
    """``tag`` of ``case`` and its reference loaded into FSDP over every rank; the paths that differ."""
    ours_model, ours_opt = build("fsdp", seed=1)
    ref_model, ref_opt = build("fsdp", seed=2)
    ours, ref = state_of(ours_model, ours_opt), state_of(ref_model, ref_opt)
    dcp.load(ours, checkpoint_id=str(root / tag), storage_reader=DatastatesStorageReader())
    dcp.load(ref, storage_reader=dcp.FileSystemReader(str(root / f"ref-{case}")))
    set_state_dict(ours_model, ours_opt, model_state_dict=ours["model"], optim_state_dict=ours["optim"])
    result = {"whole": unequal(ours, ref), "tensors": len(local_tensors(ours)),
              "changed": unequal(ours["model"], state_of(*build("fsdp", seed=1))["model"]) != []}
    model_only, ref_only = {"model": build("fsdp", seed=3)[0].state_dict()}, {"model": build("fsdp", seed=4)[0].state_dict()}
    dcp.load(model_only, checkpoint_id=str(root / tag), storage_reader=DatastatesStorageReader())
    dcp.load(ref_only, storage_reader=dcp.FileSystemReader(str(root / f"ref-{case}")))
    result["model_only"] = unequal(model_only, ref_only)
    one = {"model": {"head.weight": build("fsdp", seed=5)[0].state_dict()["head.weight"]}}
    dcp.load(one, checkpoint_id=str(root / tag), storage_reader=DatastatesStorageReader())
    result["one_key"] = unequal(one["model"], {"head.weight": ref_only["model"]["head.weight"]})
    return result


def killed(root: Path, client: Client) -> None:
    """A save rank 1 does not survive: it never returns there, and torchrun stops the other ranks."""
    model, opt = build("fsdp", seed=0)
    train_step(model, opt, 1)
    writer = DatastatesStorageWriter(client)
    if dist.get_rank() == 1:
        sent = writer.write_data

        def write_then_die(*args: Any) -> Any:
            fut = sent(*args)
            client.wait()  # its snapshot reached the daemon, copied
            say({"rank": 1, "dying": True})
            os.kill(os.getpid(), signal.SIGKILL)
            return fut

        writer.write_data = write_then_die  # type: ignore[method-assign]
    dcp.save(state_of(model, opt), checkpoint_id=str(root / "fsdp-killed"), storage_writer=writer)


def main() -> None:
    root, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    if mode == "load":
        say({"rank": dist.get_rank(), **{c: load_case(root, c, f"{c}-step2") for c in sys.argv[3:]}})
    else:
        with Client(timeout=120) as client:
            save(root, client)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Every result is written and every group destroyed: skip the interpreter's teardown, in which gloo's threads
    # once aborted a rank after its loads had passed ("terminate called without an active exception", 1 run in ~8)
    os._exit(0)
