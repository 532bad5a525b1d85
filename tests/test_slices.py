"""Reading slices of stored tensors (client/reader/restore.py ``load_slices``): what a resharded or partial DCP load reads.

A slice is read from the pieces of the file that hold it, and only those: straight into its
tensor where it is one run of the stored bytes, else through a buffer of the bytes it spans.
Every piece read is checked; a slice that does not fit raises before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from datastates.client.reader.restore import Slice, load_slices
from datastates.protocol.errors import CorruptCheckpointError, StateMismatchError

from conftest import file_index, save
from test_load_into import flip_byte, storage_at


def narrowed(t: torch.Tensor, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, o, n)
    return t


@pytest.fixture(scope="module")
def stored(shared_client: Any, shared_daemon: Any) -> tuple[Path, dict[str, Any]]:
    torch.manual_seed(3)
    state = {"rows": torch.randn(4000, 1000), "t": torch.randn(300, 2000).t(), "flat": torch.arange(100_000),
             "bf16": torch.randn(64, 64).bfloat16(), "mask": torch.rand(1000) > 0.5, "obj": b"pickled by DCP"}
    path = shared_daemon.root / "slices" / "rank0.pt"
    save(shared_client, state, path)
    return path, state


CASES = {
    "rows of a matrix (one run: straight into the tensor)": ("rows", (1000, 0), (500, 1000)),
    "columns of a matrix (through a buffer)": ("rows", (0, 10), (4000, 20)),
    "a block of a transposed tensor": ("t", (5, 7), (100, 50)),
    "a 1-D range": ("flat", (99_000,), (1000,)),
    "the last element": ("rows", (3999, 999), (1, 1)),
    "bf16 rows": ("bf16", (8, 0), (8, 64)),
    "bools": ("mask", (3,), (500,)),
    "nothing": ("flat", (10,), (0,)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_slice_equals_the_stored_tensor_narrowed(case: str, stored: tuple[Path, dict[str, Any]]) -> None:
    path, state = stored
    key, offsets, lengths = CASES[case]
    into = torch.zeros(lengths, dtype=state[key].dtype)
    top = load_slices(str(path), [Slice(key, offsets, lengths, into)])
    assert torch.equal(into, narrowed(state[key], offsets, lengths))
    assert top["obj"] == b"pickled by DCP" and top[key].device.type == "meta"  # the rest: as stored, tensors unread


def test_several_slices_of_one_storage_and_another_dtype(stored: tuple[Path, dict[str, Any]]) -> None:
    """Two slices of one stored tensor are read once; a slice into a tensor of another dtype is converted (as DCP's
    own reader's copy does), and a slice into a view of a larger tensor fills only that view."""
    path, state = stored
    a, b = torch.zeros(10, 1000), torch.zeros(3000, 1000, dtype=torch.bfloat16)
    big = torch.full((50, 30), 7.0)
    load_slices(str(path), [Slice("rows", (0, 0), (10, 1000), a), Slice("rows", (1000, 0), (3000, 1000), b),
                            Slice("t", (0, 0), (20, 10), big[5:25, 10:20])])
    assert torch.equal(a, state["rows"][:10])
    assert torch.equal(b, state["rows"][1000:4000].bfloat16())
    assert torch.equal(big[5:25, 10:20], state["t"][:20, :10])
    assert int((big == 7.0).sum()) == 50 * 30 - 20 * 10  # nothing outside the view was written


def test_a_slice_reads_only_the_pieces_that_hold_it(stored: tuple[Path, dict[str, Any]]) -> None:
    """400 of 4,000 rows (1.6 MB of a 16 MB tensor, in a 17 MB file, inside one 4 MiB piece of the format): the bytes
    this process reads (``rchar``) are that piece and the file's index, not the file."""
    path, state = stored
    header, _, _, _ = file_index(path.read_bytes())
    assert header.piece_size == 4 << 20  # the test daemon's chunk_size: the case under test
    into = torch.zeros(400, 1000)
    before = rchar()
    load_slices(str(path), [Slice("rows", (1100, 0), (400, 1000), into)])
    read = rchar() - before
    assert torch.equal(into, state["rows"][1100:1500])
    assert read < header.piece_size + (256 << 10), f"read {read} bytes of a {path.stat().st_size}-byte file"


def test_scalars_scattered_through_a_file_read_only_the_blocks_around_them(shared_client: Any,
                                                                          shared_daemon: Any) -> None:
    """A resharded DCP load asks each file for its parameters' optimizer steps: scalars between 512 KiB tensors
    here. Only the blocks around each are read (``rchar``), not the megabytes between them."""
    state = {}
    for i in range(8):
        state[f"w{i}"] = torch.randn(128 * 1024)
        state[f"step{i}"] = torch.tensor(float(i + 1))
    path = shared_daemon.root / "slices-scalars" / "rank0.pt"
    save(shared_client, state, path)
    into = [torch.zeros(()) for _ in range(8)]
    before = rchar()
    load_slices(str(path), [Slice(f"step{i}", (), (), into[i]) for i in range(8)])
    read = rchar() - before
    assert [float(t) for t in into] == [float(i + 1) for i in range(8)]
    assert read < 1 << 20, f"read {read} bytes of a {path.stat().st_size}-byte file for 8 scalars"


def rchar() -> int:
    """Bytes this process has read so far (read, pread and preadv included, O_DIRECT or not)."""
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines()
                    if line.startswith("rchar:")))


MISFITS = {
    "a key the file lacks": (Slice("nope", (0,), (1,), torch.zeros(1)), "holds no tensor"),
    "a key of no tensor": (Slice("obj", (0,), (1,), torch.zeros(1)), "holds no tensor"),
    "out of bounds": (Slice("rows", (3990, 0), (20, 1000), torch.zeros(20, 1000)), "outside its shape"),
    "another number of dimensions": (Slice("rows", (0,), (10,), torch.zeros(10)), "outside its shape"),
    "into of another shape": (Slice("rows", (0, 0), (10, 1000), torch.zeros(1000, 10)), "shape"),
}


@pytest.mark.parametrize("case", MISFITS)
def test_a_slice_that_does_not_fit_raises_naming_it_and_writes_nothing(case: str,
                                                                       stored: tuple[Path, dict[str, Any]]) -> None:
    path, _ = stored
    misfit, message = MISFITS[case]
    fine = torch.zeros(10, 1000)
    with pytest.raises(StateMismatchError, match=message) as err:
        load_slices(str(path), [Slice("rows", (0, 0), (10, 1000), fine), misfit])
    assert repr(misfit.key) in str(err.value)
    assert not fine.any() and not misfit.into.any()


def test_a_flipped_byte_in_a_piece_a_slice_reads_raises(shared_client: Any, shared_daemon: Any) -> None:
    """A byte flipped among the rows a slice reads raises, naming the tensor; one flipped in a piece the slice does
    not read is not seen (and a whole load, or ``datastatesctl verify``, would raise on it)."""
    torch.manual_seed(4)
    state = {"w": torch.randn(4000, 1000)}
    path = shared_daemon.root / "slices-corrupt" / "rank0.pt"
    save(shared_client, state, path)
    at, nbytes = storage_at(path, "w")
    flip_byte(path, at + nbytes - 100)  # in the last rows
    into = torch.zeros(100, 1000)
    load_slices(str(path), [Slice("w", (0, 0), (100, 1000), into)])
    assert torch.equal(into, state["w"][:100])
    with pytest.raises(CorruptCheckpointError, match="'w'.*checksum mismatch"):
        load_slices(str(path), [Slice("w", (3900, 0), (100, 1000), torch.zeros(100, 1000))])


def test_a_slice_into_a_tensor_no_load_can_write_raises_before_anything_is_written(
        stored: tuple[Path, dict[str, Any]]) -> None:
    """Into a tensor on a device a load does not write to (here ``meta``), an expanded one, or one whose strides make
    its elements overlap: StateMismatchError naming the key, before the other slices are written."""
    path, _ = stored
    for bad, message in ((torch.empty(4, 1000, device="meta"), "meta"), (torch.zeros(1000).expand(4, 1000), "expanded"),
                         (torch.zeros(2002).as_strided((4, 1000), (1, 2)), "overlaps itself")):
        fine = torch.zeros(10, 1000)
        with pytest.raises(StateMismatchError, match=message):
            load_slices(str(path), [Slice("rows", (0, 0), (10, 1000), fine), Slice("rows", (10, 0), (4, 1000), bad)])
        assert not fine.any()


def test_a_slice_of_a_tensor_stored_in_another_shape_than_expected_raises(stored: tuple[Path, dict[str, Any]]) -> None:
    """The caller's metadata (DCP's) says what shape the stored tensor has: a file that holds another raises, naming
    it, instead of reading the wrong elements."""
    path, _ = stored
    into = torch.zeros(10, 1000)
    with pytest.raises(StateMismatchError, match=r"shape \[4000, 1000\], not \[2000, 1000\]"):
        load_slices(str(path), [Slice("rows", (0, 0), (10, 1000), into, shape=(2000, 1000))])
    assert not into.any()
