"""A protocol fuzzer: random and mutated frames get an ERROR reply, never a crash or silence.

Thousands of cases (with ``--long``; 1,200 by default) go to one real daemon over a raw
DEALER: garbage bytes, wrong frame counts, wrong versions, unknown types, and SNAPSHOT bodies
with bogus handles, huge sizes and segments that do not exist. After every case the daemon must have answered; no
case may hit the ``internal`` boundary (that would be a bug); a well-behaved client is
served correctly before, during and after.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import datastates
from datastates.client import Client
from datastates.protocol.version import PROTOCOL_VERSION

from conftest import DaemonProc, RawPeer, assert_state_equal, save

CASES = 1500  # per test with --long; four tests, so 6,000 cases in all
SHORT_CASES = 300  # per test by default (and in `make test`): the first cases of the same derandomized sequence


@pytest.fixture
def FUZZ(long_runs: bool) -> settings:
    return settings(max_examples=CASES if long_runs else SHORT_CASES, deadline=None,
                    suppress_health_check=list(HealthCheck), derandomize=True)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=40), st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                      max_leaves=12)
types = st.sampled_from(["hello", "snapshot", "wait", "commit", "status", "bye", "heartbeat", "welcome", "error", "nope", ""]) | st.text(max_size=20)

sources = st.lists(st.fixed_dictionaries({
    "kind": st.sampled_from(["shm", "empty", "cuda_ipc", ""]) | st.text(max_size=8),
    "handle": st.sampled_from(["/torch_1_2_3", "../../etc/passwd", "/" + "x" * 300, ""]) | st.text(max_size=30),
    "nbytes": st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 1, 4096, 2**62]),
}), max_size=4)
entries = st.lists(st.fixed_dictionaries({
    "provider": st.sampled_from(["tensor", "pickle", "numpy"]) | st.text(max_size=8),
    "name": st.text(max_size=16),
    "meta": st.fixed_dictionaries({}, optional={
        "storage": st.integers(-2, 5), "dtype": st.sampled_from(["float32", "bfloat16", "nope"]),
        "shape": st.lists(st.integers(-1, 2**40), max_size=4), "stride": st.lists(st.integers(-1, 2**40), max_size=4),
        "storage_offset": st.integers(-1, 2**40), "data": st.binary(max_size=32) | values,
    }),
}), max_size=4)
snapshot_bodies = st.fixed_dictionaries({
    "path": st.sampled_from(["/etc/x.pt", "relative.pt", "/tmp/../x.pt"]) | st.text(max_size=30),
    "tag": st.sampled_from(["t1", "../x", "", "x" * 300]) | st.text(max_size=10),
    "sources": sources, "entries": entries, "root": st.integers(-2, 5),
})


def ask(peer: RawPeer, frames: list[bytes]) -> dict[str, Any]:
    """One case: the daemon must answer, and not from its internal-error boundary."""
    _header, body = peer.send(frames, timeout_s=30)
    assert body.get("code") != "internal", f"the daemon hit an internal error: {body} for {frames!r}"
    return body


def still_serves(daemon: DaemonProc, tag: str) -> None:
    with Client(daemon.endpoint, timeout=60) as c:
        state = {"w": torch.randn(64), "tag": tag}
        committed = save(c, state, daemon.root / tag / "ok.pt", tag=tag)
        assert_state_equal(state, datastates.load(committed.files[0]))


def frames_of(header: Any, body: Any) -> list[bytes]:
    return [msgpack.packb(header, use_bin_type=True), msgpack.packb(body, use_bin_type=True)]


def call(peer: RawPeer, type_: Any, body: Any, msg_id: Any = 1, version: Any = PROTOCOL_VERSION) -> dict[str, Any]:
    return ask(peer, frames_of({"version": version, "type": type_, "id": msg_id, "parent": None}, body))


@pytest.fixture
def peer(shared_daemon: DaemonProc, request: pytest.FixtureRequest) -> Iterator[RawPeer]:
    """A raw DEALER for one test's cases; afterwards a normal client must still be served."""
    p = RawPeer(shared_daemon.endpoint)
    try:
        yield p
    finally:
        p.close()
    still_serves(shared_daemon, request.node.name)


def test_garbage_frames(peer: RawPeer, FUZZ: settings) -> None:
    @FUZZ
    @given(st.lists(st.binary(max_size=200), min_size=1, max_size=4))
    def case(frames: list[bytes]) -> None:
        assert "code" in ask(peer, frames)

    case()


def test_headers_of_every_shape(peer: RawPeer, FUZZ: settings) -> None:
    @FUZZ
    @given(st.integers(-5, 5) | st.just(PROTOCOL_VERSION) | values, types, values, values)
    def case(version: Any, type_: Any, msg_id: Any, body: Any) -> None:
        call(peer, type_, body, msg_id, version)

    case()


def test_snapshot_bodies_from_a_known_client(peer: RawPeer, shared_daemon: DaemonProc, FUZZ: settings) -> None:
    """Past HELLO, so the cases reach path checks, providers and shared-memory opening."""
    call(peer, "hello", {"pid": 1, "name": "fuzz"})
    ids = iter(range(2, 10**9))

    @FUZZ
    @given(snapshot_bodies)
    def case(body: dict) -> None:
        body = {**body, "path": str(shared_daemon.root / "fz" / "f.pt")} if body["tag"] == "t1" else body
        reply = call(peer, "snapshot", body, next(ids))
        assert "code" in reply or "snapshot_id" in reply

    case()


def test_wait_and_commit_bodies(peer: RawPeer, FUZZ: settings) -> None:
    call(peer, "hello", {"pid": 1, "name": "fuzz"})

    @FUZZ
    @given(st.sampled_from(["wait", "commit"]), st.fixed_dictionaries({}, optional={"snapshot_ids": values, "tag": values}))
    def case(type_: str, body: dict) -> None:
        call(peer, type_, body, 7)

    case()


# -- deep cases: valid-looking snapshots over real memory -----------------------------------------

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "int64": 8, "uint8": 1, "bool": 1, "complex64": 8}
TAG_CHARS = "abcXYZ019._+=-"


class RealSources:
    """Real memory a raw client can name: buffers of this process (read in place) and /dev/shm segments."""

    def __init__(self) -> None:
        self.buffers = [torch.arange(n, dtype=torch.uint8) for n in (1, 64, 4096, 65536)]
        self.segments = [torch.UntypedStorage._new_using_filename_cpu(n) for n in (64, 4096)]

    def desc(self, i: int) -> dict[str, Any]:
        if i < len(self.buffers):
            b = self.buffers[i]
            return {"kind": "vm", "handle": f"{b.data_ptr():x}", "nbytes": b.numel()}
        s = self.segments[i - len(self.buffers)]
        return {"kind": "shm", "handle": s._share_filename_cpu_()[1].decode(), "nbytes": s.nbytes()}

    def __len__(self) -> int:
        return len(self.buffers) + len(self.segments)


@st.composite
def deep_snapshots(draw: st.DrawFn, real: RealSources, root: str) -> dict[str, Any]:
    """A SNAPSHOT that passes the shallow checks: real sources, tensor entries whose fields sit at the edges."""
    sources = [real.desc(draw(st.integers(0, len(real) - 1))) for _ in range(draw(st.integers(1, 4)))]
    if draw(st.booleans()):
        i = draw(st.integers(0, len(sources) - 1))
        sources[i] = {**sources[i], "nbytes": sources[i]["nbytes"] + draw(st.sampled_from([-1, 1, 4096]))}
    entries = []
    for _ in range(draw(st.integers(1, 5))):
        storage = draw(st.integers(-1, len(sources)))  # one past either end, now and then
        dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
        nbytes = sources[min(max(storage, 0), len(sources) - 1)]["nbytes"]
        elems = max(nbytes // DTYPE_SIZES[dtype], 0)
        ndim = draw(st.integers(0, 3))
        shape = [draw(st.integers(0, max(elems, 1) + 1)) for _ in range(ndim)]
        stride = [draw(st.integers(0, max(elems, 1))) for _ in range(ndim)]
        offset = draw(st.integers(0, elems + 1))
        entries.append({"provider": "tensor", "name": f"t{len(entries)}",
                        "meta": {"storage": storage, "dtype": dtype, "shape": shape, "stride": stride,
                                 "storage_offset": offset, "requires_grad": False, "parameter": False}})
    skeleton = b"\x80\x02]q\x00(" + b"".join(b"K%c" % i + b"Q" for i in range(len(entries))) + b"e."
    entries.append({"provider": "pickle", "name": "<skeleton>", "meta": {"data": skeleton}})
    tag = draw(st.text(TAG_CHARS, min_size=1, max_size=draw(st.sampled_from([8, 160, 170]))))
    name = draw(st.text(TAG_CHARS, min_size=1, max_size=draw(st.sampled_from([8, 198, 210]))))
    return {"path": f"{root}/{tag}/{name}", "tag": tag, "sources": sources, "entries": entries,
            "root": draw(st.sampled_from([len(entries) - 1, len(entries) - 1, -1, len(entries)]))}


def test_valid_looking_snapshots_over_real_memory(peer: RawPeer, shared_daemon: DaemonProc, long_runs: bool) -> None:
    """Past HELLO (with a probe: read in place) and past the shallow checks, into providers, regions and copies.

    Every SNAPSHOT gets a reply that is not ``internal``; every admitted one's WAIT does too.
    ``DATASTATES_FUZZ_RANDOM=1`` runs a fresh random sequence instead of the derandomized one.
    """
    import ctypes

    from datastates.protocol.liveness import pid_namespace, process_start

    real = RealSources()
    probe = ctypes.create_string_buffer(os.urandom(16), 16)
    welcome = call(peer, "hello", {"pid": os.getpid(), "name": "deep-fuzz", "host": os.uname().nodename,
                                   "pidns": pid_namespace(), "started": process_start(os.getpid()) or "",
                                   "probe": f"{ctypes.addressof(probe):x}:{probe.raw.hex()}"})
    assert welcome["vm_refused"] == "", welcome
    ids = iter(range(2, 10**9))
    seen = {"admitted": 0, "refused": 0}

    @settings(max_examples=CASES if long_runs else SHORT_CASES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=os.environ.get("DATASTATES_FUZZ_RANDOM") != "1", database=None)
    @given(deep_snapshots(real, str(shared_daemon.root / "deep")))
    def case(body: dict) -> None:
        reply = call(peer, "snapshot", body, next(ids))
        if "snapshot_id" not in reply:
            seen["refused"] += 1
            return
        seen["admitted"] += 1
        call(peer, "wait", {"snapshot_ids": [reply["snapshot_id"]]}, next(ids))

    case()
    assert seen["admitted"] > 0 and seen["refused"] > 0, f"the cases never reached one side: {seen}"


def test_a_peer_cannot_make_the_daemon_decode_another_clients_state_as_its_own(peer: RawPeer,
                                                                              shared_daemon: DaemonProc) -> None:
    """The daemon reuses what it decoded of a long field that comes again byte for byte (protocol/messages.py). A
    peer that sends the victim's entries and then, under the same key, its own (a duplicate map key), with the
    storages swapped, must not have its entries taken for the victim's: the victim's next snapshot is written as it
    is. Equally a long field that is not a field of the message is no error, and is not kept."""
    from datastates.client.capture import capture
    from datastates.protocol.schema import pack

    state = {f"layer{i}.weight": torch.full((4,), float(i)) for i in range(1500)}
    honest = capture(state)
    evil = [dataclasses.replace(e, meta={**e.meta, "storage": 1499 - e.meta["storage"]}) if e.provider == "tensor"
            else e for e in honest.entries]  # the same names and sizes, each tensor over another's storage
    assert len(pack(honest.entries)) >= 64 << 10

    def body(*fields: tuple[str, bytes]) -> bytes:
        out = msgpack.Packer(use_bin_type=True).pack_map_header(len(fields))
        return out + b"".join(msgpack.packb(k) + v for k, v in fields)

    head = msgpack.packb({"version": PROTOCOL_VERSION, "type": "snapshot", "id": 1, "parent": None})
    common = [("path", msgpack.packb("/nowhere/x.pt")), ("tag", msgpack.packb("t")), ("root", msgpack.packb(honest.root)),
              ("sources", pack(honest.sources))]
    for fields in ([("entries", pack(evil))], [("entries", pack(honest.entries)), ("entries", pack(evil))],
                   [("entries", pack(honest.entries)), ("padding", msgpack.packb(["x" * 100] * 1000))]):
        assert "code" in ask(peer, [head, body(*common, *fields)])  # unknown client: refused, after decoding
    with Client(shared_daemon.endpoint, timeout=60) as c:
        path = shared_daemon.root / "victim" / "rank0.pt"
        save(c, state, path, tag="victim")
    loaded = datastates.load(path)
    wrong = [name for name, t in state.items() if not torch.equal(loaded[name], t)]
    assert not wrong, f"{len(wrong)} tensors written as another's, first {wrong[0]}"
