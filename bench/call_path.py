"""How far one tensor travels: the files and functions of datastates it crosses from
``Client.snapshot()`` to the committed marker.

Runs a daemon in this process (its ROUTER loop on a thread, on a real ipc socket) so
one profiler sees both sides, snapshots one 1 MiB tensor, commits it, and counts the
datastates functions called (comprehensions and generator expressions aside) (each distinct one, and all calls) and the files they live
in. What the idle client and daemon call on their own (heartbeats, the client watch) is
measured for as long beforehand and left out. Run: ``.venv/bin/python bench/call_path.py``.
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import tempfile
import threading
import time

import torch
import zmq
import zmq.asyncio

import datastates
from datastates.client import Client
from datastates.daemon import config
from datastates.daemon.server import Daemon

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = tuple(os.path.join(HERE, d) + os.sep for d in ("client", "daemon", "protocol", "datastates"))


class Calls:
    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.on = False

    def __call__(self, frame, event, arg):  # noqa: ANN001
        if self.on and event == "call" and frame.f_code.co_filename.startswith(OURS):
            self.counts[(os.path.relpath(frame.f_code.co_filename, HERE), frame.f_code.co_qualname)] += 1

    def window(self, seconds: float | None = None, work=None) -> collections.Counter:  # noqa: ANN001
        self.counts = collections.Counter()
        self.on = True
        if work is not None:
            work()
        else:
            time.sleep(seconds or 0)
        self.on = False
        return self.counts


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="ds-path-")
    cfg = config.from_mapping({"endpoint": f"ipc://{tmp}/sock/d.sock", "storage": {"roots": [tmp]},
                               "host_memory": "16MiB", "chunk_size": "4MiB", "memory_restore": "none"})
    os.makedirs(f"{tmp}/sock", mode=0o700)
    ready = threading.Event()

    def serve() -> None:
        async def run() -> None:
            daemon = Daemon(cfg)
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.ROUTER)
            sock.bind(cfg.endpoint)
            ready.set()
            await daemon.serve(sock)
        asyncio.run(run())

    calls = Calls()
    threading.setprofile(calls)
    sys.setprofile(calls)
    threading.Thread(target=serve, daemon=True).start()
    ready.wait()
    with Client(endpoint=cfg.endpoint) as client:
        t = torch.arange(1 << 18, dtype=torch.float32)
        client.snapshot({"t": t}, f"{tmp}/warm/m.pt")  # first use: shm set-up, imports
        client.commit("warm").result()
        seconds = time.monotonic()

        def one() -> None:
            client.snapshot({"t": t}, f"{tmp}/step1/m.pt")
            client.commit("step1").result()

        path = dict(calls.window(work=one))
        seconds = time.monotonic() - seconds
        idle = calls.window(seconds=max(1.0, seconds))
    sys.setprofile(None)
    threading.setprofile(None)
    assert datastates.latest(tmp) == "step1"
    own = {k: n for k, n in path.items() if k not in idle and not k[1].rsplit(".", 1)[-1].startswith("<")}
    files = sorted({f for f, _ in own})
    print(f"one tensor, snapshot() to committed marker: {len(files)} files, {len(own)} distinct functions, "
          f"{sum(own.values())} calls")
    for f in files:
        names = sorted(q for g, q in own if g == f)
        print(f"  {f} ({len(names)}): {', '.join(names)}")


if __name__ == "__main__":
    main()
