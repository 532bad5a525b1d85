"""Two ranks on gloo, for tests/faults/test_dcp_resave.py: a DCP save whose coordinator's write fails, then the save
again to the same checkpoint_id. Usage: torchrun --nproc-per-node 2 dcp_failed_rank_job.py FOLDER

Rank 1's write succeeds, so it asks the daemon to commit the tag; rank 0's fails (as a full disk would), so the
coordinator never commits it. Each rank prints one ``RESULT {...}`` line: how each of the two saves ended.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from datastates.client import Client
from datastates.integrations.dcp import DatastatesStorageWriter


class FailingWriter(DatastatesStorageWriter):
    def write_data(self, *args: Any) -> Any:
        raise OSError(28, "No space left on device (injected)")


def state(n: int) -> dict[str, Any]:
    """Each save's of its own shape, so a checkpoint that mixes two does not load as either."""
    return {"model": {f"w{dist.get_rank()}": torch.full((n,), float(n))}, "step": n}


def ended(save: Callable[[], Any]) -> str:
    """'ok', or the type and message of the first rank's failure DCP wraps."""
    try:
        save()
    except CheckpointException as exc:
        first = next(iter(exc.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        return f"{type(first).__name__}: {first}"
    return "ok"


def main() -> None:
    folder = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with Client(timeout=120) as client:
        first = ended(lambda: dcp.save(state(10), checkpoint_id=folder,
                                       storage_writer=(FailingWriter if rank == 0 else DatastatesStorageWriter)(client)))
        again = ended(lambda: dcp.save(state(20), checkpoint_id=folder, storage_writer=DatastatesStorageWriter(client)))
    os.write(1, f"RESULT {json.dumps({'rank': rank, 'first': first, 'again': again})}\n".encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
