"""One fresh load in a process of its own, timed from the call until every page is touched: what a resuming job pays.

Why a process of its own: in one long process glibc hands a load's tensors the pages the previous
contender freed, already faulted in (a free of a large chunk raises its mmap threshold, and the next
tensors under it come from the heap). Measured here on a 1.5 GB file, medians of 5: ``torch.load`` of
datastates' file took 1.58 s as a process's first load and 0.92 s as its second, where
``datastates.load`` (one fresh mapping per file) took 1.05 s either way. A job that resumes after a
crash is a fresh process; bench/restore.py and bench/compare.py time every fresh load this way.

Usage: ``python bench/load_once.py KIND PATH [DEVICE]``, KIND one of KINDS; prints the seconds.
``common.in_fresh_process`` runs it, with a folder's page cache dropped first where its caller asks.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import READER_ENV  # noqa: E402
from restore import raw_read, restore_and_touch  # noqa: E402

import datastates  # noqa: E402
from datastates.client.reader import stream  # noqa: E402


def _dcp_load(path: str, device: str, ours: bool = False) -> Any:
    """DCP loads in place: a fresh process first allocates the state from the checkpoint's metadata, as here; with
    ``ours``, a checkpoint of DatastatesStorageWriter's, read by DatastatesStorageReader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from datastates.integrations.dcp import DatastatesStorageReader

    reader = DatastatesStorageReader() if ours else dcp.FileSystemReader(path)
    reader.reset(path)
    meta = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype, device=device)
             for k, m in meta.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=path, storage_reader=reader, no_dist=True)
    return state


KINDS: dict[str, Callable[[str, str], Any]] = {
    "torch.load": lambda path, device: torch.load(path, map_location=device, weights_only=False),
    "datastates.load": lambda path, device: datastates.load(path, map_location=device),
    "dcp.load": _dcp_load,
    "dcp.load via datastates": lambda path, device: _dcp_load(path, device, ours=True),
    "raw": lambda path, device: raw_read(path),
}


def main() -> int:
    kind, path = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    if READER_ENV in os.environ:
        threads, step_mib = os.environ[READER_ENV].split(",")
        stream.READ_THREADS, stream.STEP = int(threads), int(step_mib) << 20
    t0 = time.perf_counter()
    restore_and_touch(lambda: KINDS[kind](path, device))
    print(f"{time.perf_counter() - t0:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
