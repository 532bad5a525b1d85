"""Crafted checkpoint files (issue 14, item 6): a header whose author also computed its checksum.

The header's xxh64 proves nothing against a file made to harm its reader, so every size,
offset and count is checked against the others before anything is allocated from them:
each crafted header below is refused with the format's own error naming the field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.client.reader import verify
from datastates.protocol.errors import CorruptCheckpointError
from datastates.protocol.format import FileHeader

from conftest import DaemonProc, file_index, save, with_index


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
