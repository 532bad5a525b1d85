"""The trainer of the fault schedules (tests/faults/schedules.py): a real client process driven over stdin.

Every tensor it snapshots holds the step number in every element; right after ``wait()``
returns or raises it writes ``-step`` into all of them, as an optimizer step would, so a
file that mixes the snapshot with what came after it shows both values. It appends what
``wait()`` and ``commit()`` told it to a log file, one JSON object per line, the moment it
is told, so the checker still knows after this process is killed. Each line carries ``t``, the
system-wide monotonic clock, so the checker orders what two trainers were told.

Commands, one JSON object per line on stdin; one JSON reply per line on stdout:
  {"op": "client", "endpoint": ..., "fallback": null | "local", "liveness": s}
  {"op": "save", "step": n, "tag": t, "folder": f, "names": [...]}  -> {"wait": outcome}
  {"op": "dcp_twin", "step": n, "folder": f}  -> {"wait": outcome}: steps n and n + 1 saved with ``dcp.async_save``
      into checkpoint_id f, the second called as soon as the first returns (``dcp_state``'s layout)
  {"op": "drain", "timeout": s}  -> {} once every commit() has resolved or timed out
  {"op": "close"}  -> {} once the client has drained and left
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from datastates.client import Client
from datastates.integrations.dcp import DatastatesStorageWriter
from datastates.protocol.errors import DaemonUnavailable, DatastatesError

ELEMENTS = {"model.pt": (2 << 20, 1000), "optim.pt": (1 << 20, 10)}
"""Per file: a large float32 tensor (8 or 4 MiB, several rounds through the daemon's 4 MiB pool) and a small int64 one."""


def dcp_state(step: int) -> dict[str, Any]:
    """What a DCP save of ``step`` holds: model.pt's tensors and the step (an object DCP pickles)."""
    big, small = ELEMENTS["model.pt"]
    return {"w": torch.full((big,), float(step)), "i": torch.full((small,), step, dtype=torch.int64), "step": step}


class Trainer:
    def __init__(self, log: Path) -> None:
        self.log = log.open("a")
        self.lock = threading.Lock()
        self.client: Client | None = None
        self.commits: list[Future] = []
        self.state = {name: {"w": torch.zeros(big), "i": torch.zeros(small, dtype=torch.int64), "step": 0}
                      for name, (big, small) in ELEMENTS.items()}

    def record(self, **event: Any) -> None:
        with self.lock:
            self.log.write(json.dumps({**event, "t": time.monotonic()}) + "\n")
            self.log.flush()

    def fill(self, value: int) -> None:
        for state in self.state.values():
            state["w"].fill_(value)
            state["i"].fill_(value)
            state["step"] = value

    def connect(self, endpoint: str, fallback: str | None, liveness: float) -> None:
        self.close()
        self.client = Client(endpoint, timeout=30, liveness=liveness, fallback=fallback)

    def close(self) -> None:
        """Leave, as a trainer that is done does: the daemon forgets what this client left uncommitted."""
        if self.client is None:
            return
        self.drain(30)
        try:
            self.client.close(timeout=5)
        except DatastatesError:
            pass  # the daemon is gone or stalled: the client's own snapshots are already decided
        self.client = None

    def save(self, step: int, tag: str, folder: str, names: list[str]) -> str:
        assert self.client is not None
        self.fill(step)
        self.record(step=step, event="snapshot", tag=tag, folder=folder, names=names)
        try:
            for name in names:
                self.client.snapshot(self.state[name], Path(folder) / name, tag=tag)
            fut = self.client.commit(tag)
            fut.add_done_callback(lambda f, s=step: self.record(step=s, event="commit", outcome=outcome(f)))
            self.commits.append(fut)
            self.client.wait()
            told = "local" if self.client.local else "ok"
        except DaemonUnavailable:
            told = "unavailable"
        except DatastatesError as exc:
            told = f"error: {type(exc).__name__}: {exc}"
        self.fill(-step)  # the optimizer step, the moment wait() has returned or raised
        self.record(step=step, event="wait", outcome=told)
        return told

    def dcp_twin(self, step: int, folder: str) -> str:
        """Two ``dcp.async_save`` calls of one checkpoint_id with no gap (steps ``step`` and ``step + 1``, each a
        state of its own: DCP takes references); each future's outcome is its step's commit. Then the fence."""
        assert self.client is not None
        states = [dcp_state(step), dcp_state(step + 1)]
        for n in (step, step + 1):
            self.record(step=n, event="snapshot", tag=Path(folder).name, folder=folder, names=[])
        try:
            for n, state in zip((step, step + 1), states):
                fut = dcp.async_save(state, checkpoint_id=folder, storage_writer=DatastatesStorageWriter(self.client),
                                     no_dist=True)
                fut.add_done_callback(lambda f, s=n: self.record(step=s, event="commit", outcome=outcome(f)))
                self.commits.append(fut)
            self.client.wait()
            told = "ok"
        except DaemonUnavailable:
            told = "unavailable"
        except DatastatesError as exc:
            told = f"error: {type(exc).__name__}: {exc}"
        for state in states:  # the optimizer step, the moment the fence let it
            state["w"].neg_()
            state["i"].neg_()
        for n in (step, step + 1):
            self.record(step=n, event="wait", outcome=told)
        return told

    def drain(self, timeout: float) -> None:
        for fut in self.commits:
            try:
                fut.result(timeout=timeout)
            except Exception:  # noqa: BLE001 - recorded by the callback; a timeout stays unresolved
                pass
        self.commits = [f for f in self.commits if not f.done()]


def outcome(fut: Future) -> str:
    exc = fut.exception()
    return "ok" if exc is None else f"error: {type(exc).__name__}: {exc}"


def main() -> None:
    trainer = Trainer(Path(sys.argv[1]))
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        reply: dict[str, Any] = {}
        if op == "client":
            trainer.connect(**cmd)
        elif op == "save":
            reply["wait"] = trainer.save(**cmd)
        elif op == "dcp_twin":
            reply["wait"] = trainer.dcp_twin(**cmd)
        elif op == "drain":
            trainer.drain(cmd["timeout"])
        elif op == "close":
            trainer.close()
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
