"""The torch-compatible zip layout (protocol/torchzip.py): files planned before their data is known, with every
record's data on a 4 KiB boundary, that plain ``torch.load`` and Python's ``zipfile`` read.

The files here are assembled in the test from the layout's own bytes, as a writer would
stream them: local headers into the padding, each storage's raw bytes at its offset, the
central directory last.
"""

from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path
from typing import Any

import msgpack
import xxhash

import pytest
import torch

import datastates
from datastates.client.capture import capture
from datastates.protocol.format import (DATA_ALIGN, DIRECT_MIN, DIRECT_PHASE, INDEX_RECORD, MAGIC, PREAMBLE,
                                        PREAMBLE_SIZE, StorageRecord, align_up, checksum, data_offset, segments,
                                        storage_records, zip_layout)
from datastates.protocol.schema import plain
from datastates.protocol.torchzip import central_directory, data_pkl, local_header, plan_zip

from datastates.protocol.providers.tensor import DTYPES

from conftest import assert_state_equal, file_index, load_both, save
from test_dtypes import random_tensor

ALIGN = 4096


def _views() -> dict[str, Any]:
    base = torch.randn(8, 16)
    return {"base": base, "row": base[3], "slice": base[2:6, 4:12], "transposed": base.t(),
            "expanded": base[0, :4].expand(5, 4), "overlapping": base.as_strided((6, 6), (3, 1), 7)}


STATES = {
    "every dtype, sub-byte ones too": lambda: {n: random_tensor(d) for n, d in DTYPES.items()},
    "bf16 and a Parameter": lambda: {"w": torch.nn.Parameter(torch.randn(4, 4).bfloat16()),
                                     "frozen": torch.nn.Parameter(torch.randn(3), requires_grad=False)},
    "views of one storage": _views,
    "non-contiguous": lambda: {"channels_last": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
                               "column": torch.randn(10, 10)[:, 3]},
    "zero-size": lambda: {"empty": torch.empty(0), "empty_3d": torch.empty(3, 0, 2, dtype=torch.int64),
                          "empty_bf16": torch.zeros(0, 7, dtype=torch.bfloat16)},
    "scalars, lists and strings": lambda: {"step": torch.tensor(7), "lr": 0.1, "names": ["a", "b"], "t": (1, 2)},
}


def torch_records(state: Any) -> tuple[list[tuple[str, bytes | torch.UntypedStorage | None]], Any]:
    """``state`` as the records of a torch zip, its ``data.pkl`` made from the client's capture by
    ``data_pkl``, as the daemon makes it; and the capture, which holds the storages."""
    cap = capture(state)
    pkl = data_pkl(cap.entries, cap.root, [src.nbytes for src in cap.sources])
    assert pkl
    small = {"data.pkl": pkl, ".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little",
             "version": b"3\n"}
    return [*small.items(), *((f"data/{k}", s) for k, s in enumerate(cap.storages))], cap


def write_torch_zip(path: str, state: Any) -> list:
    """``state`` as a torch-compatible zip laid out by protocol/torchzip.py; its records."""
    contents, _cap = torch_records(state)
    size = [len(c) if isinstance(c, bytes) else c.nbytes() if c is not None else 0 for _, c in contents]
    records, end = plan_zip([(f"archive/{n}", n_bytes, ALIGN if n.startswith("data/") else 1, 0)
                             for (n, _), n_bytes in zip(contents, size)])
    with open(path, "wb") as f:
        for rec, (_, data) in zip(records, contents):
            f.seek(rec.header_offset)
            f.write(local_header(rec))
            assert f.tell() == rec.data_offset
            if isinstance(data, bytes):
                f.write(data)
            elif data is not None and data.nbytes():
                f.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(data).numpy()))
        f.seek(end)
        f.write(central_directory(records, end))
    return records


@pytest.mark.parametrize("name", sorted(STATES))
def test_plain_torch_load_reads_the_layout_bitwise(tmp_path, name: str) -> None:
    state = STATES[name]()
    path = str(tmp_path / "ckpt.pt")
    records = write_torch_zip(path, state)
    assert all(r.data_offset % ALIGN == 0 for r in records if "/data/" in r.name), "storage data not 4 KiB aligned"
    assert_state_equal(state, torch.load(path, weights_only=True))
    assert_state_equal(state, torch.load(path, weights_only=True, mmap=True))
    with zipfile.ZipFile(path) as z:
        assert [i.filename for i in z.infolist()] == [r.name for r in records]
        assert [i.file_size for i in z.infolist()] == [r.size for r in records]


def test_views_share_one_storage_record_after_torch_load(tmp_path) -> None:
    base = torch.arange(24, dtype=torch.float32)
    state = {"base": base, "row": base.view(4, 6)[1], "col": base.view(4, 6)[:, 2], "p": torch.nn.Parameter(base[:6])}
    path = str(tmp_path / "views.pt")
    records = write_torch_zip(path, state)
    assert sum("/data/" in r.name for r in records) == 1
    got = torch.load(path, weights_only=True)
    assert_state_equal(state, got)
    got["base"][7] = -1.0  # one storage after loading, as torch.save's own file gives
    assert got["row"][1].item() == -1.0 and isinstance(got["p"], torch.nn.Parameter)


def test_a_record_over_4_gib_takes_zip64_and_still_loads(tmp_path) -> None:
    """A storage of 4 GiB + 8 KiB (a sparse file here: nothing is written into it but its last page)."""
    big = torch.empty(2**32 + 2 * ALIGN, dtype=torch.uint8)  # never touched: no memory is used
    state = {"big": big, "small": torch.arange(10)}
    path = str(tmp_path / "big.pt")
    contents, _cap = torch_records(state)
    pkl = dict(contents)["data.pkl"]
    plan = [("big/data.pkl", len(pkl), 1, 0), ("big/version", 2, 1, 0), ("big/data/0", big.numel(), ALIGN, 0),
            ("big/data/1", state["small"].nbytes, ALIGN, 0)]
    records, end = plan_zip(plan)
    assert records[2].zip64() and records[3].zip64()  # its size, and the next one's offset
    with open(path, "wb") as f:
        for rec, data in zip(records, [pkl, b"3\n", None, state["small"].numpy().tobytes()]):
            f.seek(rec.header_offset)
            f.write(local_header(rec))
            if data is not None:
                f.write(data)
        f.seek(records[2].data_offset + big.numel() - 3)
        f.write(b"\x07\x08\x09")
        f.seek(end)
        f.write(central_directory(records, end))
    got = torch.load(path, weights_only=True, mmap=True)
    assert got["big"].numel() == big.numel() and got["big"][-3:].tolist() == [7, 8, 9] and got["big"][12345].item() == 0
    assert torch.equal(got["small"], state["small"])
    with zipfile.ZipFile(path) as z:
        assert [i.file_size for i in z.infolist()] == [r.size for r in records]


def test_a_format_1_file_still_loads_and_converts(shared_client, shared_daemon, tmp_path) -> None:
    """Files written before format 2 (no zip, no ``torch_pkl`` keys in the header) load through ``datastates.load``,
    and ``datastatesctl convert --to torch`` makes a ``torch.save`` file of them; a format-2 file it copies."""
    state = {"w": torch.randn(64, 8), "step": 3, "p": torch.nn.Parameter(torch.randn(5))}
    committed = save(shared_client, state, shared_daemon.root / "v1" / "rank0.pt")
    path, folder = Path(committed.files[0]), str(Path(committed.marker).parent)
    raw = path.read_bytes()
    header, _, _, base = file_index(raw)
    fields = {k: v for k, v in plain(header).items() if k not in ("torch_pkl", "torch_pkl_sum")}
    body = msgpack.packb(fields, default=plain, use_bin_type=True)
    index = PREAMBLE.pack(MAGIC, 1, 0, len(body), xxhash.xxh64_intdigest(body)) + body
    old = index + bytes(data_offset(len(body)) - len(index)) + raw[base:base + align_up(header.data_len, DATA_ALIGN)]
    v2 = path.with_suffix(".v2")
    path.rename(v2)
    path.write_bytes(old)
    marker = json.loads(Path(committed.marker).read_text())  # as an older daemon committed it: the v1 file's size
    marker["files"][0]["size"] = len(old)
    Path(committed.marker).write_text(json.dumps(marker))
    assert_state_equal(state, datastates.load(path))

    out = shared_daemon.ctl("convert", folder, "--to", "torch", "--out", str(tmp_path / "pt"))
    assert out.returncode == 0, out.stderr
    assert_state_equal(state, torch.load(tmp_path / "pt" / "rank0.pt", weights_only=True))
    assert INDEX_RECORD.encode() not in (tmp_path / "pt" / "rank0.pt").read_bytes()[:64], "a format-1 file copied, not converted"

    v2.rename(path)
    marker["files"][0]["size"] = path.stat().st_size
    Path(committed.marker).write_text(json.dumps(marker))
    out = shared_daemon.ctl("convert", folder, "--to", "torch", "--out", str(tmp_path / "copied"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "copied" / "rank0.pt").read_bytes() == path.read_bytes()


def as_format_2(raw: bytes) -> bytes:
    """A format-3 file's bytes laid out as format 2 wrote them: every storage on STORAGE_ALIGN (large ones too),
    its checksums, zip headers and central directory to match."""
    header, _, header_len, base = file_index(raw)
    pkl_record = zip_layout(header, PREAMBLE_SIZE + header_len).head[1]
    records, data_len = storage_records([s.nbytes for s in header.storages], 2)
    data = bytearray(align_up(data_len, DATA_ALIGN))
    storages = []
    for old, rec in zip(header.storages, records):
        data[rec.data_offset:rec.data_offset + rec.size] = raw[base + old.offset:base + old.offset + old.nbytes]
        storages.append(StorageRecord(rec.data_offset, rec.size, [
            checksum(bytes(data[at:at + n])) for at, n in segments(rec.data_offset, rec.size, header.piece_size)]))
    old_style = dataclasses.replace(header, data_len=data_len, storages=storages)
    index = old_style.encode(2)
    layout = zip_layout(old_style, len(index), 2)
    for at, local in layout.storage_headers():
        data[at:at + len(local)] = local
    pkl = raw[pkl_record.data_offset:pkl_record.data_offset + pkl_record.size]
    return layout.head_bytes(index, pkl) + bytes(data) + layout.tail


def test_a_format_2_file_still_loads_fresh_and_in_place(shared_client, shared_daemon, tmp_path) -> None:
    """Files written before format 3 (large storages on 64-byte boundaries, not DIRECT_PHASE past a page) load
    through ``datastates.load``, fresh and into a model's tensors, and through plain ``torch.load``."""
    state = {"big": torch.randn(300_000), "odd": torch.randn(1_000_003), "small": torch.arange(7), "step": 9}
    committed = save(shared_client, state, shared_daemon.root / "v2" / "rank0.pt")
    path = Path(committed.files[0])
    header, _, _, _ = file_index(path.read_bytes())
    assert any(s.nbytes >= DIRECT_MIN and s.offset % DATA_ALIGN == DIRECT_PHASE for s in header.storages)
    path.write_bytes(as_format_2(path.read_bytes()))
    header, _, _, _ = file_index(path.read_bytes())
    assert not all(s.offset % DATA_ALIGN == DIRECT_PHASE for s in header.storages if s.nbytes >= DIRECT_MIN)
    marker = json.loads(Path(committed.marker).read_text())  # as the older daemon committed it: the file's size
    marker["files"][0]["size"] = path.stat().st_size
    Path(committed.marker).write_text(json.dumps(marker))
    assert_state_equal(state, load_both(path))
    into = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    assert datastates.load(path, into=into) is into
    assert_state_equal(state, into)
