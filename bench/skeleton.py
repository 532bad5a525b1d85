"""What the trainer pays to serialize a checkpoint's Python skeleton: pickle now, or a msgpack walk.

Why: ``snapshot()`` runs in the training loop, so every millisecond of it is a millisecond
of training. Today the client pickles the whole state once with a ``persistent_id`` hook
(``datastates.client.capture.capture``): tensors become references, everything else lands
in one pickled skeleton. The alternative, "the daemon serializes it", has the client walk
only the containers (dict, OrderedDict, list, tuple) and send a msgpack description of
them, with tensors as references. The daemon cannot see the trainer's objects, so every
other leaf must still be turned into bytes in the trainer: msgpack-native scalars (None,
bool, int, float, str, bytes) go inline, anything else is pickled on its own (with the same
``persistent_id`` hook, so tensors inside such objects are still captured by reference).
A strict variant pickles every non-tensor, non-container leaf, scalars included.

It runs on ``common.gpt_state()`` at a tiny width (``--dim 64``) and vocabulary, so the
tensors are small but there are as many of them (1,168 at 24 layers) as in the real state:
the cost is per leaf, not per byte. Each way is timed in the steady state (after one
warm-up call, which moves the storages into shared memory), ``--runs`` times interleaved,
and the medians are compared. "+encode" adds packing the SNAPSHOT message, as the client
does before sending it. Both ways are checked to round-trip to the same state.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import pickle
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import gpt_state, median
from datastates.client.capture import Capture, capture
from datastates.protocol.torchzip import PICKLE_PROTOCOL
from datastates.protocol import messages as m
from datastates.protocol.descriptors import EntryDesc
from datastates.protocol.providers import get_provider

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "skeleton.json")
NATIVE = (type(None), bool, int, float, str, bytes)
INT64 = (-(1 << 63), (1 << 64) - 1)  # msgpack's integer range
_TENSOR = get_provider("tensor")


class _LeafPickler(pickle.Pickler):
    """Pickles one opaque leaf; tensors inside it still become references, as in ``capture``."""

    def __init__(self, file: io.BytesIO, walker: MsgpackWalker) -> None:
        super().__init__(file, protocol=PICKLE_PROTOCOL)
        self._w = walker

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            idx = self._w.tensor(obj, "<in object>")
            if idx is not None:
                return idx
        return None


class MsgpackWalker:
    """The client side of "the daemon serializes it": a container walk, msgpack-encoded.

    Node forms: a native scalar as itself; ``["T", entry]`` a captured tensor;
    ``["d"|"o"|"l"|"t", [...]]`` a dict (flat key/value nodes), OrderedDict, list or tuple;
    ``["r", n]`` the n-th container again (aliasing and cycles survive, as with pickle);
    ``["p", bytes]`` any other leaf, pickled alone.
    """

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.cap = Capture()
        self._tensors: dict[int, int] = {}
        self._containers: dict[int, int] = {}

    def tensor(self, obj: torch.Tensor, name: str) -> int | None:
        key = id(obj)
        if key in self._tensors:
            return self._tensors[key]
        entry = _TENSOR.capture(obj, name, self.cap)
        if entry is None:
            return None
        self._tensors[key] = self.cap.add_entry(entry)
        self.cap.keepalive.append(obj)
        return self._tensors[key]

    def node(self, obj: Any, name: str) -> Any:
        t = type(obj)
        if t in NATIVE and not self.strict and (t is not int or INT64[0] <= obj <= INT64[1]):
            return obj
        if t is dict or t is OrderedDict or t is list or t is tuple:
            key = id(obj)
            if key in self._containers:
                return ["r", self._containers[key]]
            self._containers[key] = len(self._containers)
            self.cap.keepalive.append(obj)  # ids stay unique while the walk runs
            if t is list or t is tuple:
                return ["l" if t is list else "t", [self.node(v, f"{name}.{i}" if name else str(i)) for i, v in enumerate(obj)]]
            flat: list[Any] = []
            for k, v in obj.items():
                flat.append(self.node(k, f"{name}.<key>"))
                flat.append(self.node(v, f"{name}.{k}" if name else str(k)))
            return ["d" if t is dict else "o", flat]
        if isinstance(obj, torch.Tensor):
            idx = self.tensor(obj, name or "<root>")
            if idx is not None:
                return ["T", idx]
        buf = io.BytesIO()
        _LeafPickler(buf, self).dump(obj)
        return ["p", buf.getvalue()]


def walk_capture(state: Any, strict: bool = False) -> Capture:
    """The alternative to ``capture()``: same sources and tensor entries, a msgpack root entry."""
    w = MsgpackWalker(strict)
    structure = msgpack.packb(w.node(state, ""), use_bin_type=True)
    w.cap.root = w.cap.add_entry(EntryDesc(provider="msgskel", name="<skeleton>", meta={"data": structure}))
    return w.cap


def entries_only(state: Any) -> Capture:
    """The floor both ways share: the tensor entries alone, no skeleton (not restorable)."""
    w = MsgpackWalker(False)

    def visit(obj: Any, name: str) -> None:
        if isinstance(obj, torch.Tensor):
            w.tensor(obj, name)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                visit(v, f"{name}.{k}" if name else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{name}.{i}" if name else str(i))

    visit(state, "")
    w.cap.root = w.cap.add_entry(EntryDesc(provider="msgskel", name="<skeleton>", meta={"data": b""}))
    return w.cap


def walk_decode(data: bytes, leaves: list[Any]) -> Any:
    """What the daemon (or a reader) would rebuild; ``leaves[i]`` stands for tensor entry ``i``."""
    containers: list[Any] = []

    def build(n: Any) -> Any:
        if not isinstance(n, list):
            return n
        kind, payload = n
        if kind == "T":
            return leaves[payload]
        if kind == "r":
            return containers[payload]
        if kind == "p":
            up = pickle.Unpickler(io.BytesIO(payload))
            up.persistent_load = lambda pid: leaves[pid[1]]  # type: ignore[method-assign]
            return up.load()
        if kind in ("l", "t"):
            out: list[Any] = []
            slot = len(containers)
            containers.append(out)
            out.extend(build(v) for v in payload)
            if kind == "t":
                containers[slot] = tuple(out)
                return containers[slot]
            return out
        d: dict[Any, Any] = {} if kind == "d" else OrderedDict()
        containers.append(d)
        for i in range(0, len(payload), 2):
            d[build(payload[i])] = build(payload[i + 1])
        return d

    return build(msgpack.unpackb(data, raw=False, strict_map_key=False))


def pickle_decode(data: bytes, leaves: list[Any]) -> Any:
    up = pickle.Unpickler(io.BytesIO(data))
    up.persistent_load = lambda pid: leaves[pid[1]]  # type: ignore[method-assign]
    return up.load()


def same(a: Any, b: Any) -> bool:
    """Equal, with exact container and leaf types; tensors must be the very same objects."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a.keys()) == list(b.keys()) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check_roundtrip(state: Any, cap: Capture, decode: Callable[[bytes, list[Any]], Any], what: str) -> None:
    tensors = [e for e in cap.entries if e.provider == "tensor"]
    leaves = [o for o in cap.keepalive if isinstance(o, torch.Tensor)]
    if len(leaves) != len(tensors):
        raise RuntimeError(f"{what}: {len(tensors)} tensor entries but {len(leaves)} tensors kept alive")
    if not same(state, decode(cap.entries[cap.root].meta["data"], leaves)):
        raise RuntimeError(f"{what}: the skeleton does not round-trip to the state")


def encode(cap: Capture) -> int:
    """Pack the SNAPSHOT message the client would send; returns its size."""
    frames = m.encode(m.Snapshot(path="/tmp/x/model_states.pt", tag="x", sources=cap.sources, entries=cap.entries, root=cap.root), 1)
    return sum(len(f) for f in frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: .venv/bin/python bench/skeleton.py --runs 20")
    ap.add_argument("--layers", type=int, default=24, help="GPT layers: 48 + 12/layer tensors per copy, x4 with AdamW (default 24)")
    ap.add_argument("--dim", type=int, default=64, help="model width; small, so only the tensor count matters (default 64)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary rows (default 1024)")
    ap.add_argument("--ctx", type=int, default=256, help="position rows (default 256)")
    ap.add_argument("--runs", type=int, default=20, help="timed calls of each way, interleaved; medians (default 20)")
    ap.add_argument("--out", default=RESULTS, help=f"JSON results (default {os.path.relpath(RESULTS)})")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be >= 1")

    state = gpt_state(layers=args.layers, dim=args.dim, vocab=args.vocab, ctx=args.ctx)
    ways: dict[str, Callable[[Any], Capture]] = {
        "pickle (capture, now)": capture,
        "msgpack walk": lambda s: walk_capture(s, strict=False),
        "msgpack walk, strict": lambda s: walk_capture(s, strict=True),
        "tensor entries only": entries_only,
    }
    decoders = {"pickle (capture, now)": pickle_decode, "msgpack walk": walk_decode, "msgpack walk, strict": walk_decode}
    info: dict[str, dict[str, Any]] = {}
    for name, fn in ways.items():  # warm-up: moves every storage into /dev/shm once, then checks
        cap = fn(state)
        if name in decoders:
            check_roundtrip(state, cap, decoders[name], name)
        info[name] = {"entries": len(cap.entries), "sources": len(cap.sources),
                      "root_bytes": len(cap.entries[cap.root].meta["data"]), "message_bytes": encode(cap)}
    times: dict[str, list[float]] = {n: [] for n in ways}
    times_enc: dict[str, list[float]] = {n: [] for n in ways}
    for _ in range(args.runs):
        for name, fn in ways.items():
            gc.collect()
            t0 = time.perf_counter()
            cap = fn(state)
            t1 = time.perf_counter()
            encode(cap)
            t2 = time.perf_counter()
            times[name].append(t1 - t0)
            times_enc[name].append(t2 - t0)
            del cap

    base = "pickle (capture, now)"
    n_tensors = info[base]["entries"] - 1
    print(f"gpt_state(layers={args.layers}, dim={args.dim}, vocab={args.vocab}, ctx={args.ctx}): "
          f"{n_tensors} tensors, {info[base]['sources']} storages; median of {args.runs} calls after one warm-up")
    print(f"{'way':<24}{'ms/call':>9}{'skeleton':>10}{'+encode ms':>12}{'x pickle':>10}{'+enc x':>8}{'root B':>9}{'msg B':>9}")
    summary: dict[str, dict[str, Any]] = {}
    b, be = median(times[base]), median(times_enc[base])
    floor = median(times["tensor entries only"])
    for name in ways:
        t, te = median(times[name]), median(times_enc[name])
        summary[name] = info[name] | {"ms": 1e3 * t, "ms_with_encode": 1e3 * te, "ratio_vs_pickle": t / b,
                                      "skeleton_ms": 1e3 * (t - floor),
                                      "ratio_vs_pickle_with_encode": te / be, "us_per_tensor": 1e6 * t / n_tensors,
                                      "all_ms": [1e3 * x for x in times[name]]}
        print(f"{name:<24}{1e3 * t:9.2f}{1e3 * (t - floor):10.2f}{1e3 * te:12.2f}{t / b:10.2f}{te / be:8.2f}{info[name]['root_bytes']:9d}{info[name]['message_bytes']:9d}")
    walk, pick = summary["msgpack walk"], summary[base]
    sk_ratio = walk["skeleton_ms"] / pick["skeleton_ms"] if pick["skeleton_ms"] > 0 else float("nan")
    print("\n(skeleton = ms/call minus 'tensor entries only', the per-tensor work both ways must do)")
    print(f"msgpack walk / pickle: {walk['ratio_vs_pickle']:.2f} per call, {walk['ratio_vs_pickle_with_encode']:.2f} with encode, "
          f"{sk_ratio:.2f} on the skeleton part alone")
    print(f"skeleton share of capture(): {pick['skeleton_ms'] / pick['ms']:.0%}; "
          f"capture() costs {pick['us_per_tensor']:.1f} us per tensor")

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items() if k != "out"} | {"tensors": n_tensors,
                                                                                   "torch": torch.__version__},
                   "summary": summary, "ratios": {"walk_over_pickle": walk["ratio_vs_pickle"],
                                                  "walk_over_pickle_with_encode": walk["ratio_vs_pickle_with_encode"],
                                                  "walk_over_pickle_skeleton_only": sk_ratio}}, f, indent=2)
    print(f"wrote {os.path.relpath(args.out)}")


if __name__ == "__main__":
    main()
