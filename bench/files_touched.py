"""The product modules one tensor passes through: from ``Client.snapshot()`` to bytes on disk, and back through
``datastates.load(path, into=state)``.

This runs one small save (a CPU tensor and a step count) through a real ``datastatesd`` and restores it in place,
recording, in the trainer (the client) and in the daemon (every thread, from SNAPSHOT until the tag is committed):
- the product modules that ran a function meanwhile (helpers, bookkeeping and housekeeping threads included);
- the modules a newcomer follows: those on the call stack each time the tensor is handed on (``HANDOVERS``: taken,
  sent, read off the wire, placed in its file, copied, written, made durable, committed; matched to its target,
  read, checked and copied in).
Imports done before the save are not counted; start-up and the daemon's status are not either.

    .venv/bin/python bench/files_touched.py           # the modules, by side, and the counts of distinct ones
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import BIN, daemon_process  # noqa: E402

import datastates  # noqa: E402
from datastates.client import Client  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("protocol", "client", "daemon", "integrations", "datastates")
HANDOVERS = {
    "TensorProvider.capture", "Connection.request",  # the trainer: taken, and each request handed to the connection
    "decode_body", "plan_snapshot", "Engine.run", "VmRegion.read_into", "VmRegion.read_batch", "ShmRegion.read_into",
    "CudaIpcRegion.read_into", "FileHeader.encode", "PosixStorage.write", "PosixStorage.finalize",
    "CommitLedger._publish", "PosixStorage.publish",  # the daemon: read off the wire ... committed
    "open_file", "_Match.walk", "Stream.fill", "Stream._piece", "_File.preadv",  # load(into=)
}
"""The functions (qualified names) that take the tensor, or its bytes, on a step."""


class Recorder:
    """A profile hook for every thread: the code files that ran a function, and those on the stack at a handover."""

    def __init__(self) -> None:
        self.on = False
        self.ran: set[str] = set()
        self.path: set[str] = set()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        self.ran.add(frame.f_code.co_filename)
        if frame.f_code.co_qualname in HANDOVERS:
            while frame is not None:
                self.path.add(frame.f_code.co_filename)
                frame = frame.f_back

    def install(self) -> None:
        threading.setprofile(self)
        sys.setprofile(self)

    def modules(self) -> dict[str, set[str]]:
        return {"ran": {m for f in self.ran if (m := _module(f))}, "path": {m for f in self.path if (m := _module(f))}}


_DAEMON = """
import json, os, signal, sys
sys.path.insert(0, os.environ['DS_BENCH'])
from files_touched import Recorder
recorder = Recorder()
def start(*_):
    recorder.on = True
def dump(*_):
    recorder.on = False
    with open(os.environ['DS_TOUCHED'] + '.part', 'w') as f:
        json.dump({k: sorted(v) for k, v in recorder.modules().items()}, f)
    os.rename(os.environ['DS_TOUCHED'] + '.part', os.environ['DS_TOUCHED'])
signal.signal(signal.SIGRTMIN + 3, start)
signal.signal(signal.SIGRTMIN + 4, dump)
recorder.install()
from datastates.daemon.main import main
sys.argv[0] = 'datastatesd'
main()
"""
"""The daemon, run with a profile hook on every thread: one real-time signal starts recording, another writes what
ran."""


def _module(filename: str) -> str | None:
    """The product module a code object's file is, relative to the repository, or None."""
    try:
        rel = Path(os.path.realpath(filename)).relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in PRODUCT and rel.suffix == ".py" else None


def _recorded(fn: Callable[[], Any]) -> dict[str, set[str]]:
    """The product modules that ran, and those on a handover's stack, in this process while ``fn`` ran."""
    recorder = Recorder()
    recorder.on = True
    recorder.install()
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return recorder.modules()


def main() -> None:
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 7}
    with tempfile.TemporaryDirectory(prefix="ds-touched-") as folder:
        root = os.path.join(folder, "ckpt")
        os.makedirs(root)
        path = os.path.join(root, "run", "step7", "model.pt")
        touched = os.path.join(folder, "touched.txt")
        command = [os.path.join(BIN, "python"), "-c", _DAEMON]
        env = {**os.environ, "DS_TOUCHED": touched, "DS_BENCH": os.path.dirname(os.path.abspath(__file__))}
        with daemon_process(root, command, env=env) as (proc, endpoint):
            client = Client(endpoint)
            client.snapshot({"w": torch.zeros(4), "step": 0}, os.path.join(root, "warm", "t", "m.pt"), tag="t")
            client.wait()
            client.commit("t").result()  # the first save's lazy imports and set-up are not one tensor's path
            proc.send_signal(signal.SIGRTMIN + 3)
            time.sleep(0.2)

            def save() -> None:
                client.snapshot(state, path, tag="step7")
                client.wait()
                client.commit("step7").result()

            saving = _recorded(save)
            proc.send_signal(signal.SIGRTMIN + 4)
            for _ in range(100):
                if os.path.exists(touched):
                    break
                time.sleep(0.1)
            daemon = {k: set(v) for k, v in json.loads(Path(touched).read_text()).items()}
            client.close()
        into = {"w": torch.empty(1 << 16, dtype=torch.float32), "step": 0}
        datastates.load(path, into=into)  # lazy imports of the reader, as for any first load
        loading = _recorded(lambda: datastates.load(path, into=into))
        assert torch.equal(into["w"], state["w"]), "the restore differs from the save"
    sides = {"trainer, saving": saving, "daemon": daemon, "trainer, load(into=)": loading}
    for kind, title in (("ran", "modules that ran"), ("path", "modules on the tensor's path")):
        print(f"== {title}")
        for side, modules in sides.items():
            print(f"{side} ({len(modules[kind])}):")
            for module in sorted(modules[kind]):
                print(f"  {module}")
    print(json.dumps({kind: {"distinct": len(set().union(*(m[kind] for m in sides.values()))),
                             **{side: len(m[kind]) for side, m in sides.items()}} for kind in ("ran", "path")}))


if __name__ == "__main__":
    main()
