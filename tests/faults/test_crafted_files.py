"""Crafted checkpoint files: a header whose author also computed its checksum.

The header's xxh64 proves nothing against a file made to harm its reader, so every size,
offset and count is checked against the others before anything is allocated from them:
each crafted header below is refused with the format's own error naming the field.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.capture import capture
from datastates.client.reader.stream import verify
from datastates.protocol.errors import CorruptCheckpointError
from datastates.protocol.format import FileHeader, checksum
from datastates.protocol.torchzip import torch_data_pkl

from conftest import DATASTATESCTL, DaemonProc, file_index, save, with_index


@pytest.fixture(scope="module")
def good(shared_daemon: DaemonProc) -> Path:
    state = {"w": torch.randn(3, 1 << 12), "b": torch.randn(100), "step": 7}
    with Client(shared_daemon.endpoint, timeout=60) as c:
        return Path(save(c, state, shared_daemon.root / "crafted" / "model_states.pt").files[0])


def craft(good: Path, dst: Path, change: Callable[[FileHeader], FileHeader]) -> Path:
    """``good`` with its header changed by ``change``, re-encoded with a matching checksum, data kept."""
    raw = good.read_bytes()
    dst.write_bytes(with_index(raw, change(file_index(raw)[0])))
    return dst


def storage0(h: FileHeader, **fields: Any) -> FileHeader:
    return dataclasses.replace(h, storages=[dataclasses.replace(h.storages[0], **fields), *h.storages[1:]])


CASES: dict[str, tuple[Callable[[FileHeader], FileHeader], str]] = {
    "piece size 0": (lambda h: dataclasses.replace(h, piece_size=0), "piece_size 0"),
    "piece size 1": (lambda h: dataclasses.replace(h, piece_size=1), "piece_size 1 "),
    "piece size -1": (lambda h: dataclasses.replace(h, piece_size=-1), "piece_size -1"),
    "piece size unaligned": (lambda h: dataclasses.replace(h, piece_size=4097), "piece_size 4097"),
    "negative data length": (lambda h: dataclasses.replace(h, data_len=-4096), "data_len"),
    "storage past the data": (lambda h: storage0(h, offset=h.data_len), "outside the data region"),
    "negative storage size": (lambda h: storage0(h, nbytes=-1), "outside the data region"),
    "huge storage": (lambda h: storage0(h, nbytes=1 << 62), "outside the data region"),
    "missing checksums": (lambda h: storage0(h, checksums=[]), "checksums for the"),
    "short checksum": (lambda h: storage0(h, checksums=[b"x"] * len(h.storages[0].checksums)), "checksums for the"),
    "root out of range": (lambda h: dataclasses.replace(h, root=len(h.entries)), "root entry"),
    "negative data.pkl size": (lambda h: dataclasses.replace(h, torch_pkl=-1), "torch_pkl -1"),
    "data.pkl checksum of 3 bytes": (lambda h: dataclasses.replace(h, torch_pkl_sum=b"abc"), "torch_pkl"),
}


def test_a_skeleton_cut_inside_an_opcode_is_a_corrupt_file(good: Path, tmp_path: Path) -> None:
    """``r`` (LONG_BINPUT) with no argument: torch's safe unpickler meets it as a struct.error, which is refused
    as the format's own error (found by the fuzzer of tests/faults/test_fuzz_reader.py)."""
    def cut(h: FileHeader) -> FileHeader:
        entries = list(h.entries)
        entries[h.root] = dataclasses.replace(entries[h.root], meta={"data": b"r"})
        return dataclasses.replace(h, entries=entries)

    path = craft(good, tmp_path / "model_states.pt", cut)
    with pytest.raises(CorruptCheckpointError, match="not a valid pickle"):
        datastates.load(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_header_is_refused_naming_the_field(good: Path, tmp_path: Path, case: str) -> None:
    change, says = CASES[case]
    path = craft(good, tmp_path / "model_states.pt", change)
    for read in (lambda: datastates.load(path, weights_only=True), lambda: verify(path)):
        with pytest.raises(CorruptCheckpointError, match="header") as exc:
            read()
        assert says in str(exc.value) and str(path) in str(exc.value), exc.value


def test_the_control_a_re_encoded_unchanged_header_loads(good: Path, tmp_path: Path) -> None:
    path = craft(good, tmp_path / "model_states.pt", lambda h: h)
    assert torch.equal(datastates.load(path)["w"], datastates.load(good)["w"])


def _point_b_at_w(tensors: dict[int, dict], w: int, b: int) -> None:
    """``b`` read from ``w``'s storage, its first 100 elements."""
    tensors[b] = {**tensors[b], "storage": tensors[w]["storage"]}


def _shift_w(tensors: dict[int, dict], w: int, b: int) -> None:
    """``w`` read one row on: its last two rows instead of its three."""
    tensors[w] = {**tensors[w], "shape": [2, 1 << 12], "storage_offset": 1 << 12}


@pytest.mark.parametrize("lie", [_point_b_at_w, _shift_w], ids=["another storage", "another offset"])
def test_a_data_pkl_that_disagrees_with_the_index_is_refused(good: Path, tmp_path: Path,
                                                            lie: Callable[[dict[int, dict], int, int], None]) -> None:
    """The file's author rewrites ``data.pkl`` so that ``torch.load`` rebuilds a key from another
    storage or offset, and recomputes every checksum (data.pkl's in the index, the index's own; torch checks no
    zip CRC). ``verify``, ``datastatesctl verify`` and ``datastates.load`` refuse it: ``data.pkl`` is not the one
    the index's skeleton and tensor entries make, so ``torch.load`` would return other tensors."""
    raw = good.read_bytes()
    header = file_index(raw)[0]
    index = {e.name: i for i, e in enumerate(header.entries)}
    tensors = {i: dict(e.meta) for i, e in enumerate(header.entries) if e.provider == "tensor"}
    lie(tensors, index["w"], index["b"])
    pkl = torch_data_pkl(header.entries[header.root].meta["data"], tensors, [s.nbytes for s in header.storages])
    forged = dataclasses.replace(header, torch_pkl=len(pkl), torch_pkl_sum=checksum(pkl))
    path = tmp_path / "model_states.pt"
    path.write_bytes(with_index(raw, forged, pkl=pkl))

    theirs, ours = torch.load(path, weights_only=True), datastates.load(path, verify=False)
    assert not all(torch.equal(theirs[k], ours[k]) for k in ("w", "b")), "the forgery should mislead torch.load"
    for read in (lambda: verify(path), lambda: datastates.load(path)):
        with pytest.raises(CorruptCheckpointError, match="data.pkl") as exc:
            read()
        assert str(path) in str(exc.value) and "torch.load" in str(exc.value), exc.value
    out = subprocess.run([DATASTATESCTL, "verify", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout.startswith("CORRUPT") and "data.pkl" in out.stdout, out.stdout + out.stderr


def w_meta(**fields: Any) -> Callable[[FileHeader], FileHeader]:
    """The header with tensor ``w``'s meta changed by ``fields``."""
    def change(h: FileHeader) -> FileHeader:
        entries = [dataclasses.replace(e, meta={**e.meta, **fields}) if e.name == "w" else e for e in h.entries]
        return dataclasses.replace(h, entries=entries)
    return change


VIEWS: dict[str, tuple[Callable[[FileHeader], FileHeader], str]] = {
    "2^62 elements, stride 0": (w_meta(shape=[1 << 62], stride=[0], storage_offset=0), "no real tensor"),
    "2^31 x 2^31 elements, stride 0": (w_meta(shape=[1 << 31, 1 << 31], stride=[0, 0]), "no real tensor"),
    "a size past int64": (w_meta(shape=[1 << 63], stride=[0]), "shape must hold integers"),
    "an offset past int64": (w_meta(shape=[0], stride=[1], storage_offset=1 << 63), "do not describe a view"),
    "a dtype that is a list": (w_meta(dtype=["float32"]), "unknown dtype"),
    "a view past its storage": (w_meta(shape=[4, 1 << 12]), "the view needs"),
}


@pytest.mark.parametrize("case", sorted(VIEWS))
def test_a_crafted_tensor_entry_is_refused_naming_the_key_and_the_fault(good: Path, tmp_path: Path, case: str) -> None:
    """A tensor entry no real tensor matches (a stride-0 shape of 2^62 elements loaded as such a
    view; a size past int64 was reported as "the skeleton is not a valid pickle") is refused by ``datastates.load``
    (either unpickler, checked or not) and ``verify``, naming the key and what is wrong."""
    change, says = VIEWS[case]
    path = craft(good, tmp_path / "model_states.pt", change)
    for read in (lambda: datastates.load(path), lambda: datastates.load(path, verify=False, weights_only=False),
                 lambda: verify(path)):
        with pytest.raises(CorruptCheckpointError, match="entry 'w' is malformed") as exc:
            read()
        assert says in str(exc.value) and "not a valid pickle" not in str(exc.value), exc.value


def test_a_file_whose_skeleton_is_pickle_protocol_4_is_refused_by_verify_and_load(
        good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file an older daemon admitted: its skeleton of pickle protocol 4 made a data.pkl that
    torch.load cannot read ("pickle data was truncated"), yet verify passed it. Now verify and datastates.load name
    the skeleton's protocol."""
    monkeypatch.setattr("datastates.client.capture.PICKLE_PROTOCOL", 4)
    skeleton = capture({"w": torch.randn(3, 1 << 12), "b": torch.randn(100), "step": 7}).entries[-1].meta["data"]

    def proto4(h: FileHeader) -> FileHeader:
        entries = list(h.entries)
        entries[h.root] = dataclasses.replace(entries[h.root], meta={"data": skeleton})
        return dataclasses.replace(h, entries=entries)

    path = craft(good, tmp_path / "model_states.pt", proto4)
    for read in (lambda: verify(path), lambda: datastates.load(path)):
        with pytest.raises(CorruptCheckpointError, match="the skeleton is a pickle of protocol 4") as exc:
            read()
        assert str(path) in str(exc.value), exc.value
