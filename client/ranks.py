"""A rank's place in its job, read from the launcher's environment (torchrun first, then Slurm)."""

from __future__ import annotations

import os
from typing import Mapping

from datastates.protocol.descriptors import Ranks

_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
_SLURM = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID",
          "SLURM_STEP_NUM_NODES", "SLURM_JOB_ID")
"""The step's sizes, set only inside ``srun``: a batch script's own python is a job of one, not of the allocation."""
_SLURM_ATTEMPT = ("SLURM_STEP_ID", "SLURM_RESTART_COUNT")
"""What tells one attempt of a Slurm job from another on every node alike: an srun run again is a new step, a
requeued job counts its restarts. (torchrun's own restart count is not: an agent whose workers did not fail
restarts them without counting it.)"""


def ranks_from_env(env: Mapping[str, str] = os.environ) -> Ranks:
    """torchrun's variables if set (it may itself run under srun), else an srun step's, else a job of one."""
    for names in (_TORCHRUN, _SLURM):
        if names[2] in env:
            rank, local, world, local_world, node, nodes, job = (env.get(n, "") for n in names)
            world_size = int(world or 1)
            local_world = local_world or env.get("LOCAL_SIZE", "")  # the deepspeed launcher's name for it
            local_world_size = int((local_world or str(world_size)).split("(")[0].split(",")[0])
            return Ranks(
                rank=int(rank), local_rank=int(local or 0), world_size=world_size, local_world_size=local_world_size,
                node_rank=int(node or 0), num_nodes=int(nodes or max(1, world_size // local_world_size)),
                job=attempt(job, *(env.get(n, "") for n in _SLURM_ATTEMPT)) if names is _SLURM else job,
            ).check()
    return Ranks()


def attempt(job: str, step: str, restarts: str) -> str:
    """A Slurm job's name with its step and restart count: each attempt of a restarted job commits its own tags,
    never with another attempt's done markers (daemon/gather.py)."""
    job = f"{job}.{step}" if step else job
    return f"{job}#{restarts}" if restarts not in ("", "0") else job
