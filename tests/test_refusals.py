"""What the daemon and the reader refuse, and how: a clear error with a stable code, and service goes on.

(a) malformed or foreign wire traffic, (b) paths a client may not write, (c) damaged
checkpoint files, (d) bad node configs, (e) what the client refuses before sending.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import torch
import yaml

import datastates
from datastates.client import Client
from datastates.protocol.errors import (
    CommitError,
    CorruptCheckpointError,
    DaemonNotRunning,
    InvalidRequestError,
    PathNotAllowedError,
    UnsupportedFormatError,
)
from datastates.protocol.format import PREAMBLE_SIZE
from datastates.protocol.version import PROTOCOL_VERSION

from conftest import (DATASTATESCTL, DATASTATESD, DaemonProc, RawPeer, assert_state_equal, file_index, refused_run,
                      run_datastatesd_many, save, wait_ready)

# -- (a) the wire ------------------------------------------------------------------------


@pytest.fixture
def peer(shared_daemon: DaemonProc) -> Iterator[RawPeer]:
    p = RawPeer(shared_daemon.endpoint)
    yield p
    p.close()


def assert_still_serves(daemon: DaemonProc) -> None:
    """A normal client still gets its snapshot through, and nothing crashed inside the daemon."""
    with Client(daemon.endpoint, timeout=60) as c:
        state = {"w": torch.randn(100)}
        committed = save(c, state, daemon.root / "after-refusal" / "ok.pt", tag="after-refusal")
        assert_state_equal(state, datastates.load(committed.files[0]))
    assert "internal error" not in daemon.log_text()
    assert "Traceback" not in daemon.log_text()


def test_other_protocol_version_is_refused(peer: RawPeer, shared_daemon: DaemonProc) -> None:
    """A peer of another version learns both versions, so the operator knows what to upgrade."""
    header, body = peer.request("status", {}, msg_id=5, version=PROTOCOL_VERSION + 98)
    assert header["type"] == "error" and header["version"] == PROTOCOL_VERSION
    assert body["code"] == "version_mismatch"
    assert str(PROTOCOL_VERSION + 98) in body["message"] and f"version {PROTOCOL_VERSION}" in body["message"]
    assert_still_serves(shared_daemon)


def test_unknown_message_type(peer: RawPeer, shared_daemon: DaemonProc) -> None:
    """A newer client's message type gets a named refusal that the sender can match to its request."""
    header, body = peer.request("defragment", {}, msg_id=7)
    assert body["code"] == "unknown_message" and "defragment" in body["message"]
    assert header["parent"] == 7, "a readable header gets its reply matched to the request"


def test_reply_type_sent_as_request(peer: RawPeer) -> None:
    """A known type that is only ever a reply is a protocol error, not something the daemon tries to serve."""
    _, body = peer.request("welcome", {"client_id": "x", "daemon_pid": 1}, msg_id=8)
    assert body["code"] == "protocol"


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param([b"\xc1\xc1 not msgpack", b"\x80"], id="garbage-header"),
        pytest.param([msgpack.packb({"version": PROTOCOL_VERSION, "type": "status", "id": 3, "parent": None})[:-4], b"\x80"],
                     id="truncated-header"),
        pytest.param([msgpack.packb({"version": PROTOCOL_VERSION, "type": "hello", "id": 4, "parent": None}),
                      msgpack.packb({"pid": 1, "name": "x"})[:-2]], id="truncated-body"),
        pytest.param([msgpack.packb({"version": PROTOCOL_VERSION, "type": "status", "id": 5, "parent": None})],
                     id="one-frame"),
        pytest.param([msgpack.packb({"version": PROTOCOL_VERSION, "type": "status", "id": 6, "parent": None}), b"\x80", b"extra"],
                     id="three-frames"),
        pytest.param([msgpack.packb([1, 2, 3]), b"\x80"], id="header-not-a-map"),
        pytest.param([msgpack.packb({"version": PROTOCOL_VERSION, "type": "hello", "id": 9, "parent": None}),
                      msgpack.packb({"pid": "not a number", "name": "x"})], id="wrong-field-type"),
    ],
)
def test_malformed_frames_are_protocol_errors(peer: RawPeer, shared_daemon: DaemonProc, frames: list[bytes]) -> None:
    """Anything that is not [header, body] in msgpack gets code 'protocol' back, never silence or a crash."""
    header, body = peer.send(frames)
    assert header["type"] == "error" and body["code"] == "protocol", body
    assert header["parent"] in (None, 3, 4, 5, 6, 9)
    assert_still_serves(shared_daemon)


def test_snapshot_before_hello(peer: RawPeer) -> None:
    """A peer that never said HELLO (or whose daemon restarted) is told to introduce itself."""
    snapshot = {"path": "/tmp/x.pt", "tag": "t", "sources": [], "root": 0,
                "entries": [{"provider": "pickle", "name": "<skeleton>", "meta": {"data": b"\x80\x02N."}}]}
    _, body = peer.request("snapshot", snapshot)
    assert body["code"] == "unknown_client" and "HELLO" in body["message"]
    _, body = peer.request("wait", {"snapshot_ids": []})
    assert body["code"] == "unknown_client"


def test_dotdot_path_refused_by_the_daemon_itself(peer: RawPeer, shared_daemon: DaemonProc) -> None:
    """A client that skips normalising still cannot use '..' components, even ones that would resolve inside a root."""
    _, welcome = peer.request("hello", {"pid": os.getpid(), "name": "raw"})
    assert "client_id" in welcome
    path = f"{shared_daemon.root}/a/../escape.pt"
    snapshot = {"path": path, "tag": "t", "sources": [], "root": 0,
                "entries": [{"provider": "pickle", "name": "<skeleton>", "meta": {"data": b"\x80\x02N."}}]}
    _, body = peer.request("snapshot", snapshot, msg_id=2)
    assert body["code"] == "path_not_allowed" and ".." in body["message"]
    assert not (shared_daemon.root / "escape.pt").exists()


def test_a_view_of_more_elements_than_any_tensor_is_refused_at_admission(shared_daemon: DaemonProc) -> None:
    """A stride-0 view of 2^62 elements (``expand`` of one element) was admitted and loaded back
    as such a view; no real tensor has that many elements, so the daemon refuses it naming the key."""
    path = shared_daemon.root / "huge-view" / "m.pt"
    with Client(shared_daemon.endpoint, timeout=60) as c:
        with pytest.raises(InvalidRequestError, match="'mask'.*no real tensor"):
            c.snapshot({"w": torch.randn(10), "mask": torch.zeros(1).expand(1 << 62)}, path)
            c.wait()
    assert not path.exists()
    assert_still_serves(shared_daemon)


@pytest.mark.parametrize("protocol", [4, 5])
def test_a_skeleton_of_pickle_protocol_4_or_5_is_refused_at_admission(
        shared_daemon: DaemonProc, protocol: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that pickles its skeleton with protocol 4 or 5 (frames, implicit memo slots) is
    refused at admission saying so; data.pkl made from it would be one torch.load cannot read ("pickle data was
    truncated"), though datastates.load and verify would pass the file."""
    path = shared_daemon.root / f"proto{protocol}" / "m.pt"
    with monkeypatch.context() as patch, Client(shared_daemon.endpoint, timeout=60) as c:
        patch.setattr("datastates.client.capture.PICKLE_PROTOCOL", protocol)
        with pytest.raises(InvalidRequestError, match=f"skeleton is a pickle of protocol {protocol}"):
            c.snapshot({"w": torch.randn(300), "step": 3, "names": ["a"] * 40}, path)
            c.wait()
    assert not path.exists()
    assert_still_serves(shared_daemon)


# -- (b) paths ---------------------------------------------------------------------------


@pytest.fixture
def outside(shared_daemon: DaemonProc, tmp_path: Path) -> Path:
    """A folder beside the storage root that no client may write to."""
    folder = tmp_path / "outside"
    folder.mkdir()
    return folder


def _refused_paths(root: Path, outside: Path) -> dict[str, Path]:
    (root / "escape").symlink_to(outside, target_is_directory=True)
    (outside / "target.pt").write_bytes(b"precious")
    (root / "linked.pt").symlink_to(outside / "target.pt")
    return {
        "outside-the-roots": outside / "global_step1" / "model.pt",
        "dotdot-escaping-the-root": root / ".." / outside.name / "model.pt",
        "dotdot-into-another-folder": root / "a" / ".." / ".." / "model.pt",
        "symlinked-folder": root / "escape" / "global_step1" / "model.pt",
        "symlinked-file": root / "linked.pt",
        "file-name-too-long": root / "global_step1" / ("m" * 300 + ".pt"),
        "reserved-temp-name": root / "global_step1" / "model.pt.dstmp",
        "reserved-marker-name": root / "global_step1" / "datastates-commit.x.json",
    }


def test_paths_a_client_may_not_write(shared_client: Client, shared_daemon: DaemonProc, outside: Path) -> None:
    """Every way out of storage.roots is a PathNotAllowedError from snapshot(), nothing is written, and service goes on."""
    root = shared_daemon.root
    state = {"w": torch.randn(64)}
    for why, path in _refused_paths(root, outside).items():
        with pytest.raises(PathNotAllowedError, match="refused") as exc:
            shared_client.snapshot(state, path, tag="refused")
        assert exc.value.code == "path_not_allowed", why

    assert sorted(p.name for p in outside.rglob("*")) == ["target.pt"], "nothing was written outside the root"
    assert (outside / "target.pt").read_bytes() == b"precious"
    assert not (root / "escape" / "global_step1").exists()
    with pytest.raises(CommitError):  # a refused snapshot leaves nothing to commit
        shared_client.commit("refused").result(timeout=60)
    assert_still_serves(shared_daemon)


# -- (c) damaged files -------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_file(shared_daemon: DaemonProc) -> tuple[Path, dict[str, Any]]:
    """A committed checkpoint, and the state it holds; tests corrupt copies of it."""
    state = {
        "model": {"layer1.weight": torch.randn(300, 100), "layer1.bias": torch.randn(100)},
        "step": 7,
    }
    with Client(shared_daemon.endpoint, timeout=60) as c:
        committed = save(c, state, shared_daemon.root / "global_step7" / "model_states.pt")
    return Path(committed.files[0]), state


def copy_of(good: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy" / good.name
    dst.parent.mkdir()
    shutil.copyfile(good, dst)
    return dst


def data_offset_of(path: Path, key: str) -> int:
    """File offset of the first byte of the tensor named ``key``, read from the file's own header."""
    header, _, _, base = file_index(path.read_bytes())
    (entry,) = [e for e in header.entries if e.name == key]
    return base + header.storages[entry.meta["storage"]].offset


def flip(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_good_file_loads(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The control: an untouched copy loads, so the failures below are the corruption's doing."""
    good, state = good_file
    assert_state_equal(state, datastates.load(copy_of(good, tmp_path)))


def test_byte_appended(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The header declares the file size, so even one extra byte is caught."""
    path = copy_of(good_file[0], tmp_path)
    with path.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(CorruptCheckpointError, match="appended") as exc:
        datastates.load(path)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("keep", ["half", "inside-header", "preamble-only", "empty"])
def test_truncated(good_file: tuple[Path, dict[str, Any]], tmp_path: Path, keep: str) -> None:
    """A file cut short anywhere (a crash mid-copy, a full disk) is named as truncated."""
    path = copy_of(good_file[0], tmp_path)
    size = path.stat().st_size
    os.truncate(path, {"half": size // 2, "inside-header": PREAMBLE_SIZE + 10, "preamble-only": PREAMBLE_SIZE, "empty": 0}[keep])
    with pytest.raises(CorruptCheckpointError, match="truncated") as exc:
        datastates.load(path)
    assert str(path) in str(exc.value)


def test_flipped_byte_in_tensor_data(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A flipped data byte names the file and the tensor; verify=False skips the checksums and returns the bytes as they are."""
    good, state = good_file
    path = copy_of(good, tmp_path)
    flip(path, data_offset_of(path, "model.layer1.weight") + 1001)

    with pytest.raises(CorruptCheckpointError, match="checksum") as exc:
        datastates.load(path)
    assert str(path) in str(exc.value)
    assert "model.layer1.weight" in str(exc.value)

    loaded = datastates.load(path, verify=False)
    want = state["model"]["layer1.weight"].view(-1).view(torch.uint8)
    got = loaded["model"]["layer1.weight"].view(-1).view(torch.uint8)
    flipped = (want != got).nonzero().flatten()  # outside the assert: pytest would explain a tensor comparison
    assert (len(flipped), flipped[:4].tolist()) == (1, [1001])
    assert torch.equal(loaded["model"]["layer1.bias"], state["model"]["layer1.bias"])


def test_flipped_byte_in_header(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """The header has its own checksum: a damaged index is refused before it is trusted."""
    path = copy_of(good_file[0], tmp_path)
    _, at, header_len, _ = file_index(path.read_bytes())
    flip(path, at + PREAMBLE_SIZE + header_len // 2)
    with pytest.raises(CorruptCheckpointError, match="header") as exc:
        datastates.load(path)
    assert str(path) in str(exc.value)


def test_not_a_datastates_file(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A torch.save file (a common mix-up) or any other file is UnsupportedFormatError, not a corrupt checkpoint."""
    theirs = tmp_path / "torch_save.pt"
    torch.save(good_file[1], theirs)
    text = tmp_path / "notes.txt"
    text.write_text("these are not the tensors you are looking for\n" * 10)
    for path in (theirs, text):
        with pytest.raises(UnsupportedFormatError, match="not a datastates checkpoint") as exc:
            datastates.load(path)
        assert str(path) in str(exc.value)


def test_newer_format_version(good_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """A file from a newer writer is refused by version, so the user knows to upgrade the reader."""
    path = copy_of(good_file[0], tmp_path)
    _, at, _, _ = file_index(path.read_bytes())
    with path.open("r+b") as f:
        f.seek(at + 8)  # the preamble's version
        f.write(struct.pack("<I", 99))
    with pytest.raises(UnsupportedFormatError, match="99"):
        datastates.load(path)


# -- (d) node config ---------------------------------------------------------------------


def _write_config(tmp_path: Path, short_tmp: Path, **overrides: Any) -> Path:
    cfg: dict[str, Any] = {"endpoint": f"ipc://{short_tmp}/d.sock", "storage": {"roots": [str(tmp_path)]}}
    cfg.update(overrides)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


BAD_CONFIGS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "unknown-key": ({"flush_thread": 4}, ["flush_thread"]),
    "unknown-storage-key": ({"storage": {"roots": ["/tmp"], "mirror": "/x"}}, ["mirror"]),
    "host-memory-not-a-size": ({"host_memory": "lots"}, ["host_memory", "lots"]),
    "zero-flush-threads": ({"flush_threads": 0}, ["flush_threads"]),
    "relative-root": ({"storage": {"roots": ["relative/ckpt"]}}, ["storage.roots", "relative/ckpt"]),
    "chunk-not-aligned": ({"chunk_size": "1000"}, ["chunk_size"]),
    "budget-below-one-chunk": ({"host_memory": "1MiB", "chunk_size": "4MiB"}, ["host_memory"]),
}


@pytest.fixture(scope="module")
def bad_config_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Any]]]:
    """datastatesd run on every bad config, side by side: (the config, the run) by case."""
    short = Path(tempfile.mkdtemp(prefix="ds-"))
    configs = {}
    for case, (overrides, _names) in BAD_CONFIGS.items():
        (short / case).mkdir()
        configs[case] = _write_config(tmp_path_factory.mktemp(case), short / case, **overrides)
    runs = run_datastatesd_many({case: ["--node-config", str(config)] for case, config in configs.items()}, timeout=30)
    yield {case: (configs[case], runs[case]) for case in BAD_CONFIGS}
    shutil.rmtree(short, ignore_errors=True)


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_config_stops_the_daemon(bad_config_runs: dict[str, tuple[Path, Any]], case: str) -> None:
    """datastatesd refuses to start, exits non-zero, and names the offending key and value."""
    _overrides, names = BAD_CONFIGS[case]
    config, run = bad_config_runs[case]
    run = refused_run(run)
    assert run.returncode != 0
    for name in names:
        assert name in run.stderr, run.stderr
    assert str(config) in run.stderr
    assert "Traceback" not in run.stderr


def test_no_config_file_starts_with_defaults(tmp_path: Path, short_tmp: Path) -> None:
    """With no node.yaml the daemon serves from the default endpoint in $XDG_RUNTIME_DIR, with default roots and budget."""
    env = {k: v for k, v in os.environ.items() if k != "DATASTATES_ENDPOINT"}
    env["XDG_RUNTIME_DIR"] = str(short_tmp)
    endpoint = f"ipc://{short_tmp}/datastates/datastatesd.sock"
    log = tmp_path / "datastatesd.log"
    proc = subprocess.Popen([DATASTATESD], cwd=tmp_path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_ready(endpoint, proc, log)
        explicit = subprocess.run([DATASTATESCTL, "--endpoint", endpoint, "status", "--json"],
                                  capture_output=True, text=True, timeout=60)
        assert explicit.returncode == 0, explicit.stderr
        d = json.loads(explicit.stdout)["daemon"]
        assert d["endpoint"] == endpoint and d["pid"] == proc.pid
        assert os.path.realpath(tmp_path) in d["roots"]
        assert d["host_memory"]["budget_bytes"] == 2 << 30
        assert (short_tmp / "datastates").stat().st_mode & 0o777 == 0o700, "the socket folder is private"
        implicit = subprocess.run([DATASTATESCTL, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert implicit.returncode == 0, "ctl finds the daemon on the same default endpoint"
        assert json.loads(implicit.stdout)["daemon"]["pid"] == proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


# -- (e) refused in the trainer, before anything reaches the daemon ------------------------


def test_state_that_cannot_be_pickled(shared_client: Client, shared_daemon: DaemonProc) -> None:
    """An object pickle cannot handle is an InvalidRequestError at snapshot(), naming the problem."""
    with pytest.raises(InvalidRequestError, match="cannot be serialized"):
        shared_client.snapshot({"w": torch.randn(3), "hook": lambda x: x}, shared_daemon.root / "global_step1" / "m.pt")
    assert not (shared_daemon.root / "global_step1" / "m.pt").exists()


@pytest.mark.parametrize("folder", ["my checkpoint", ".hidden", "-dash"])
def test_folder_name_that_cannot_be_a_tag(shared_client: Client, shared_daemon: DaemonProc, folder: str) -> None:
    """The default tag is the folder's name; one that could not name a marker file is refused with the rules."""
    with pytest.raises(InvalidRequestError, match="invalid tag"):
        shared_client.snapshot({"w": torch.randn(3)}, shared_daemon.root / folder / "model.pt")


def test_a_tag_ending_in_a_newline_is_refused(shared_client: Client, shared_daemon: DaemonProc) -> None:
    """A tag of "step1" and a newline would name a marker file with a newline in it: refused like any invalid tag
    (the check's pattern ended in ``$``, which also matches before a trailing newline)."""
    path = shared_daemon.root / "step1" / "m.pt"
    with pytest.raises(InvalidRequestError, match="invalid tag 'step1\\\\n'"):
        shared_client.snapshot({"w": torch.randn(3)}, path, tag="step1\n")
    assert not path.exists()


def test_client_without_a_daemon(short_tmp: Path) -> None:
    """A trainer started before its daemon is told at once that none runs there, and how to start one."""
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    with pytest.raises(DaemonNotRunning, match="no datastatesd is running") as exc:
        Client(endpoint, timeout=1)
    assert endpoint in str(exc.value)
