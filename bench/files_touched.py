"""The product modules one tensor passes through: from ``Client.snapshot()`` to bytes on disk, and back through
``datastates.load(path, into=state)``.

A newcomer following a tensor reads every module whose code runs for it. This runs one small save (a CPU
tensor and a step count) through a real ``datastatesd`` and restores it in place, recording which product modules
run a function meanwhile: in the trainer (the client) and in the daemon (every thread, from SNAPSHOT until the
tag is committed). Imports done before the save are not counted; start-up and the daemon's status are not either.

    .venv/bin/python bench/files_touched.py           # the modules, by side, and the count of distinct ones
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

_DAEMON = """
import os, signal, sys, threading
seen, on = set(), [False]
def record(frame, event, arg):
    if on[0] and event == 'call':
        seen.add(frame.f_code.co_filename)
def start(*_):
    on[0] = True
def dump(*_):
    on[0] = False
    with open(os.environ['DS_TOUCHED'], 'w') as f:
        f.write('\\n'.join(sorted(seen)))
signal.signal(signal.SIGRTMIN + 3, start)
signal.signal(signal.SIGRTMIN + 4, dump)
threading.setprofile(record)
sys.setprofile(record)
from datastates.daemon.main import main
sys.argv[0] = 'datastatesd'
main()
"""
"""The daemon, run with a profile hook on every thread: one real-time signal starts recording, another writes what ran."""


def _module(filename: str) -> str | None:
    """The product module a code object's file is, relative to the repository, or None."""
    try:
        rel = Path(os.path.realpath(filename)).relative_to(REPO)
    except ValueError:
        return None
    return rel.as_posix() if rel.parts[0] in PRODUCT and rel.suffix == ".py" else None


def _recorded(fn: Callable[[], Any]) -> set[str]:
    """The product modules that ran a function in this process while ``fn`` ran, on any thread."""
    seen: set[str] = set()

    def record(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    threading.setprofile(record)
    sys.setprofile(record)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return {m for f in seen if (m := _module(f))}


def main() -> None:
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 7}
    with tempfile.TemporaryDirectory(prefix="ds-touched-") as folder:
        root = os.path.join(folder, "ckpt")
        os.makedirs(root)
        path = os.path.join(root, "run", "step7", "model.pt")
        touched = os.path.join(folder, "touched.txt")
        command = [os.path.join(BIN, "python"), "-c", _DAEMON]
        with daemon_process(root, command, env={**os.environ, "DS_TOUCHED": touched}) as (proc, endpoint):
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
                if os.path.exists(touched) and os.path.getsize(touched):
                    break
                time.sleep(0.1)
            daemon = {m for f in Path(touched).read_text().split("\n") if (m := _module(f))}
            client.close()
        into = {"w": torch.empty(1 << 16, dtype=torch.float32), "step": 0}
        datastates.load(path, into=into)  # lazy imports of the reader, as for any first load
        loading = _recorded(lambda: datastates.load(path, into=into))
        assert torch.equal(into["w"], state["w"]), "the restore differs from the save"
    sides = {"trainer, saving": saving, "daemon": daemon, "trainer, load(into=)": loading}
    for side, modules in sides.items():
        print(f"{side} ({len(modules)}):")
        for module in sorted(modules):
            print(f"  {module}")
    every = set().union(*sides.values())
    print(json.dumps({"distinct_modules": len(every), **{side: len(m) for side, m in sides.items()}}))


if __name__ == "__main__":
    main()
