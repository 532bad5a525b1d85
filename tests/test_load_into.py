"""Restoring into the tensors a job already has: ``datastates.load(path, into=state)`` and
``Client.restore(root, name, into=state)`` (client/reader/restore.py).

What a user relies on, each shown with a real daemon, real files and (for the kills) a real
trainer process:

- the checkpoint's values land bitwise in ``into``'s own tensors (same objects, same memory),
  from storage and from the daemon's memory replica, a model's parameters included;
- a checkpoint that does not fit ``into`` (shape, dtype, a key one side lacks, a tensor where
  the other holds something else) raises StateMismatchError naming the key, and ``into`` is
  bitwise as it was;
- corrupt or truncated bytes raise, never come back as a restored state, and corrupt bytes
  never reach a tensor;
- the daemon SIGKILLed at any point of a memory restore gives a raise or a bitwise-correct
  state, never wrong bytes as success;
- awkward layouts (views, strides, tied weights, empty and 0-dim tensors, every common dtype,
  parameters, tuples, plain values) and states spanning many read pieces.
"""

from __future__ import annotations

import collections
import copy
import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

import datastates
import datastates.protocol.storage.posix as posix_module
import datastates.client.reader.stream as stream_module
from datastates.client import Client
from datastates.protocol import errors
from datastates.protocol.errors import CorruptCheckpointError, StateMismatchError
from datastates.protocol.format import DIRECT_PHASE, PREAMBLE_SIZE, zip_layout

from conftest import (DaemonFactory, DaemonProc, assert_state_equal, assert_tensor_bitwise, file_index, same_storage,
                      save)

CHUNK = 256 << 10
"""The daemon's chunk_size: the file's checksummed pieces, so that even a small state has several."""

NT = collections.namedtuple("NT", "w step")
"""A namedtuple holding a tensor, as some optimizers' states do."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One datastatesd for the module, with small pieces."""
    factory = DaemonFactory(tmp_path_factory.mktemp("into"))
    yield factory.start(chunk_size=f"{CHUNK}B")
    factory.stop_all_later()


@pytest.fixture(scope="module")
def trainer(node: DaemonProc) -> Iterator[Client]:
    c = Client(node.endpoint, timeout=60)
    yield c
    c.close()


@pytest.fixture
def run(node: DaemonProc, request: pytest.FixtureRequest) -> Path:
    """This test's own run folder under the daemon's root."""
    folder = node.root / request.node.name.replace("[", "-").replace("]", "")
    folder.mkdir()
    return folder


# -- helpers ---------------------------------------------------------------------------


def committed(c: Client, state: Any, run: Path, tag: str = "step1") -> Path:
    """``state`` saved and committed as ``run/tag/rank0.pt``; its path."""
    path = run / tag / "rank0.pt"
    save(c, state, path, tag=tag)
    return path


def replica_of(c: Client, path: Path) -> Path:
    """The daemon's committed replica of ``path``, once written (it is written beside the storage file, and may land
    after the commit's reply)."""
    for _ in range(2400):  # a hang guard
        files = [Path(r["file"]) for r in c.status()["replicas"]["replicas"]
                 if r["path"] == str(path) and r["committed"]]
        if files and files[0].exists():
            return files[0]
        time.sleep(0.05)
    raise AssertionError(f"the daemon never held a replica of {path}: {c.status()['replicas']}")


def supersede(c: Client, run: Path) -> None:
    """Commit a newer tag of the same rank file: the daemon drops step1's replica, so restoring step1 reads storage."""
    committed(c, {"other": torch.zeros(1)}, run, tag="step2")


def zeros_like(state: Any) -> Any:
    """``state``'s structure with every tensor zeroed (own memory, same shape, dtype and strides): an ``into``."""
    if isinstance(state, torch.Tensor):
        out = torch.empty_strided(state.shape, state.stride(), dtype=state.dtype).zero_()
        return nn.Parameter(out, requires_grad=state.requires_grad) if isinstance(state, nn.Parameter) else out
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, tuple):
        items = [zeros_like(v) for v in state]
        return type(state)(*items) if hasattr(state, "_fields") else tuple(items)
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return state


def zeros_at(state: dict[str, torch.Tensor], phase: int) -> dict[str, torch.Tensor]:
    """``state``'s flat dict of contiguous tensors, zeroed, each starting ``phase`` bytes past a page: an ``into``
    laid out in memory as a format-3 file lays out its large storages (phase 64, as glibc maps torch's large tensors),
    or not, whatever the allocator's state in this process."""
    out = {}
    for key, t in state.items():
        buf = torch.zeros(t.nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        at = (phase - buf.data_ptr()) % mmap.PAGESIZE
        out[key] = buf[at:at + t.nbytes].view(t.dtype).view(t.shape)
    return out


def tensors(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of ``state`` by its key path."""
    if isinstance(state, torch.Tensor):
        return {path: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in tensors(value, f"{path}/{key}").items()}


def identities(state: Any) -> dict[str, tuple[int, int]]:
    """(id, data_ptr) of each tensor of ``state``: an in-place load keeps both."""
    return {k: (id(t), t.data_ptr()) for k, t in tensors(state).items()}


def flip_byte(path: Path, at: int) -> None:
    """Flip byte ``at`` of ``path``: its size (and so its commit marker) still holds."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def storage_at(path: Path, name: str) -> tuple[int, int]:
    """(file offset, bytes) of the storage of the tensor entry ``name``."""
    header, _, _, base = file_index(path.read_bytes())
    entry = next(e for e in header.entries if e.name == name)
    rec = header.storages[entry.meta["storage"]]
    return base + rec.offset, rec.nbytes


def model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"w": torch.randn(100_000), "b": torch.randn(300, 7), "i": torch.arange(1000) * seed, "step": seed}


# -- 1. in place, bitwise, from storage and from memory --------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Sequential(nn.Linear(32, 256), nn.LayerNorm(256), nn.Linear(256, 32))
        self.head = nn.Linear(32, 64, bias=False)
        self.register_buffer("count", torch.tensor(0, dtype=torch.int64))


def net(seed: int, tied: bool = False) -> Net:
    torch.manual_seed(seed)
    m = Net()
    if tied:
        m.head.weight = m.emb.weight
    m.count.fill_(seed)
    return m


@pytest.mark.parametrize("how", ["load", "memory", "storage"])
def test_a_models_state_is_restored_bitwise_into_its_own_tensors(how: str, trainer: Client, run: Path) -> None:
    """``into={"model": model.state_dict(), ...}``: the model's own parameters and buffers get the values, their
    memory unchanged (no fresh tensor swapped in), and the plain values are the file's."""
    saved = {"model": net(1).state_dict(), "step": 7, "lr": 0.125, "name": "run-a", "note": None}
    path = committed(trainer, saved, run)
    if how == "storage":
        supersede(trainer, run)
    elif how == "memory":
        replica_of(trainer, path)
    model = net(2)
    into = {"model": model.state_dict(), "step": 0, "lr": 0.0, "name": "", "note": "x"}
    before = identities(into)
    params = {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()}
    if how == "load":
        out = datastates.load(path, into=into)
    else:
        restored = trainer.restore(run, "rank0.pt", tag="step1", into=into)
        assert restored is not None and restored.source == how, restored
        out = restored.state
    assert out is into
    assert_state_equal(saved, into)
    assert identities(into) == before
    assert {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()} == params
    assert_state_equal(saved["model"], model.state_dict())
    assert all(p.requires_grad for p in model.parameters())


# -- 2. a checkpoint that does not fit: StateMismatchError naming the key, into unchanged ----------


def fitting() -> dict[str, Any]:
    """The file's structure; each case below breaks ``into`` at one key, after ``a`` (which fits)."""
    torch.manual_seed(3)
    return {"a": torch.randn(64, 3), "b": {"c": torch.arange(5), "n": 3}, "t": (torch.randn(2), 1.5)}


def _shape(s: dict) -> None:
    s["b"]["c"] = torch.zeros(6, dtype=torch.int64)


def _dtype(s: dict) -> None:
    s["b"]["c"] = torch.zeros(5, dtype=torch.int32)


def _into_has_more(s: dict) -> None:
    s["b"]["extra"] = torch.zeros(2)


def _file_has_more(s: dict) -> None:
    del s["b"]["c"]


def _tensor_in_file(s: dict) -> None:
    s["b"]["c"] = 5


def _tensor_in_into(s: dict) -> None:
    s["b"]["n"] = torch.zeros(1)


def _tuple_length(s: dict) -> None:
    s["t"] = (torch.zeros(2),)


MISFITS: dict[str, tuple[Callable[[dict], None], str]] = {
    "shape": (_shape, "['b']['c']"),
    "dtype": (_dtype, "['b']['c']"),
    "into-has-a-key-the-file-lacks": (_into_has_more, "['b']['extra']"),
    "file-has-a-key-into-lacks": (_file_has_more, "['b']['c']"),
    "tensor-in-file-not-in-into": (_tensor_in_file, "['b']['c']"),
    "tensor-in-into-not-in-file": (_tensor_in_into, "['b']['n']"),
    "tuple-length": (_tuple_length, "['t']"),
}


@pytest.fixture(scope="module")
def fitting_file(trainer: Client, node: DaemonProc) -> Path:
    run = node.root / "misfits"
    run.mkdir()
    return committed(trainer, fitting(), run)


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_misfit_raises_naming_the_key_and_writes_nothing(case: str, fitting_file: Path) -> None:
    into = zeros_like(fitting())
    breaks, key = MISFITS[case]
    breaks(into)
    before = copy.deepcopy(into)
    with pytest.raises(StateMismatchError) as err:
        datastates.load(fitting_file, into=into)
    assert err.value.detail["key"] == key, err.value
    assert key in str(err.value) and str(fitting_file) in str(err.value)
    assert_state_equal(before, into)  # "a" fits and comes first: not written either


def test_a_misfit_through_client_restore_from_memory_raises_too(trainer: Client, run: Path) -> None:
    replica_of(trainer, committed(trainer, fitting(), run))
    into = zeros_like(fitting())
    _shape(into)
    before = copy.deepcopy(into)
    with pytest.raises(StateMismatchError, match=r"\['b'\]\['c'\]"):
        trainer.restore(run, "rank0.pt", into=into)
    assert_state_equal(before, into)


def test_strict_false_adds_the_files_keys_into_lacks(fitting_file: Path) -> None:
    into = zeros_like(fitting())
    del into["b"]["c"]
    a = into["a"]
    out = datastates.load(fitting_file, into=into, strict=False)
    assert out is into and into["a"] is a
    expected = fitting()
    assert_tensor_bitwise(expected["b"].pop("c"), into["b"].pop("c"), "the added key")
    assert_state_equal(expected, into)


def test_strict_false_still_refuses_a_key_the_file_lacks(fitting_file: Path) -> None:
    """Documented: strict=False adds the checkpoint's extra keys; a key only ``into`` has is never silently kept."""
    into = zeros_like(fitting())
    _into_has_more(into)
    before = copy.deepcopy(into)
    with pytest.raises(StateMismatchError, match=r"\['b'\]\['extra'\]"):
        datastates.load(fitting_file, into=into, strict=False)
    assert_state_equal(before, into)


# -- 3. corrupt bytes raise: a load never returns what it could not check ------------------------------------------------


def corruptible(trainer: Client, run: Path) -> tuple[Path, dict[str, Any]]:
    state = model_state(4)
    return committed(trainer, state, run), state


def test_a_flipped_byte_in_a_tensor_raises(trainer: Client, run: Path) -> None:
    """Each piece is hashed as it is copied out (client/reader/stream.py): a flipped byte raises, naming the tensor, and the
    load never returns what it could not check (``into`` may hold the bad piece's bytes by then)."""
    path, state = corruptible(trainer, run)
    at, nbytes = storage_at(path, "b")
    flip_byte(path, at + nbytes // 2)
    with pytest.raises(CorruptCheckpointError, match="'b'.*checksum mismatch"):
        datastates.load(path, into=zeros_like(state))
    supersede(trainer, run)  # from storage through Client.restore: raises too
    with pytest.raises(CorruptCheckpointError):
        trainer.restore(run, "rank0.pt", tag="step1", into=zeros_like(state))


@pytest.mark.parametrize("where", ["inside", "in its first bytes"])
def test_a_flipped_byte_in_a_tensor_read_straight_with_o_direct_raises(where: str, trainer: Client, run: Path) -> None:
    """A tensor aligned as its storage is in the file takes its whole blocks by O_DIRECT, hashed where they land, and
    its first bytes through the bounce buffer: a flipped byte in either raises, naming the tensor."""
    state = straddling(5)
    path = committed(trainer, state, run)
    at, nbytes = storage_at(path, "t5")
    flip_byte(path, at + (nbytes // 2 if where == "inside" else 10))
    with pytest.raises(CorruptCheckpointError, match="'t5'.*checksum mismatch"):
        datastates.load(path, into=zeros_at(state, DIRECT_PHASE))


def test_a_corrupt_memory_replica_gives_way_to_storage(trainer: Client, run: Path) -> None:
    """A byte of the daemon's replica flipped: reading it (a mapped tmpfs file) raises CorruptCheckpointError, and
    the restore reads storage, bitwise, into the same tensors; it never returns the replica's wrong bytes."""
    path, state = corruptible(trainer, run)
    replica = replica_of(trainer, path)
    at, nbytes = storage_at(replica, "w")
    flip_byte(replica, at + nbytes - 1)
    with pytest.raises(CorruptCheckpointError, match="'w'.*checksum mismatch"):
        datastates.load(replica, into=zeros_like(state))
    into = zeros_like(state)
    ptrs = identities(into)
    restored = trainer.restore(run, "rank0.pt", into=into)
    assert restored is not None and restored.source == "storage" and "corrupt" in restored.why_not_memory, restored
    assert_state_equal(state, into)
    assert identities(into) == ptrs


def test_a_damaged_zip_local_header_in_the_data_region_raises(trainer: Client, run: Path) -> None:
    """What torch.load would misread: a storage's local header, between tensors, which no checksum covers."""
    path, state = corruptible(trainer, run)
    raw = path.read_bytes()
    header, _, header_len, base = file_index(raw)
    inside = [(at, h) for at, h in zip_layout(header, PREAMBLE_SIZE + header_len).storage_headers() if at > 0]
    at, local = inside[-1]
    flip_byte(path, base + at + len(local) // 2)
    with pytest.raises(CorruptCheckpointError, match="local header"):
        datastates.load(path, into=zeros_like(state))


# -- 4. truncated storage; the daemon killed mid-restore -------------------------------------------


def test_a_file_truncated_before_the_restore_raises_and_writes_nothing(trainer: Client, run: Path) -> None:
    path, state = corruptible(trainer, run)
    os.truncate(path, path.stat().st_size - 200_000)
    into = zeros_like(state)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        datastates.load(path, into=into)
    assert_state_equal(zeros_like(state), into)


def test_a_file_truncated_while_it_is_read_raises(trainer: Client, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut to its first tensor's half after its header and zip records were checked, just as its data region is
    opened for reading: the restore raises, through Client.restore too."""
    path, state = corruptible(trainer, run)
    supersede(trainer, run)
    at, nbytes = storage_at(path, "w")
    cut: list[int] = []

    def cut_then(opener: Callable[[str], int]) -> Callable[[str], int]:
        def cut_then_open(name: str) -> int:
            if name == str(path) and not cut:
                cut.append(at + nbytes // 2)
                os.truncate(path, cut[0])
            return opener(name)
        return cut_then_open

    # through the page cache, or with O_DIRECT where the targets lie as in the file (as the allocator placed them)
    for name in ("open_sequential", "open_for_reading"):
        monkeypatch.setattr(posix_module, name, cut_then(getattr(posix_module, name)))
    with pytest.raises(CorruptCheckpointError, match="file ends"):
        trainer.restore(run, "rank0.pt", tag="step1", into=zeros_like(state))
    assert cut and path.stat().st_size == cut[0]  # the case under test: cut as it was opened to be read


KILLER = """
import json, os, signal, sys, time, torch
import datastates.client.reader.stream as stream
from datastates.client import Client
endpoint, daemon_pid, root, point, piece = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
stream.READ_PIECE = piece  # many read pieces, so that the kill lands between them
torch.manual_seed(5)
state = {f"t{i}": torch.randn(n) for i, n in enumerate((1_000_003, 777_777, 1_500_000, 5, 640_000))}
state["step"] = 5
killed = []

def kill():
    killed.append(point)
    os.kill(daemon_pid, signal.SIGKILL)
    while True:  # until it is dead (a zombie of the test process, which reaps it)
        try:
            with open(f"/proc/{daemon_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    if point.endswith("+folder"):  # and its replica folder deleted, as its node's next daemon does
        import shutil
        shutil.rmtree(os.path.dirname(replica[0]))

replica = []
def hook(event, args):
    if event == "open" and args and str(args[0]).startswith("/dev/shm/") and str(args[0]).endswith("rank0.pt"):
        replica.append(str(args[0]))
        if point == "open" and not killed:
            kill()
sys.addaudithook(hook)
check, seen = stream.check_local_headers, []
def checked(*args):
    seen.append(1)
    if point.split("+")[0] == f"piece{len(seen)}" and not killed:
        kill()
    return check(*args)
stream.check_local_headers = checked

c = Client(endpoint, timeout=60)
c.snapshot(state, f"{root}/step1/rank0.pt")
c.wait()
c.commit("step1").result(timeout=120)
for _ in range(2400):  # a hang guard: until the daemon's replica is written (it may land after the commit's reply)
    if any(r["committed"] and os.path.exists(r["file"]) for r in c.status()["replicas"]["replicas"]):
        break
    time.sleep(0.05)
target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
ptrs = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
out = {"killed": killed, "pieces": len(seen), "replica": replica}
try:
    got = c.restore(root, "rank0.pt", into=target)
    out.update(source=got.source, why_not=got.why_not_memory, same=got.state is target, step=target["step"],
               unequal=[k for k, v in state.items() if isinstance(v, torch.Tensor) and not torch.equal(v, target[k])],
               moved=[k for k, p in ptrs.items() if target[k].data_ptr() != p])
except Exception as exc:
    out.update(raised=type(exc).__name__, why=str(exc))
out.update(killed=killed, pieces=len(seen))
print(json.dumps(out), flush=True)
os._exit(0)
"""
PIECES = 15
"""The trainer's state in 1 MiB read pieces."""
KILL_POINTS = ("open", "piece1", "piece8+folder", f"piece{PIECES}")
"""When the trainer SIGKILLs the daemon during its memory restore: at its open of the replica (after the daemon's
reply, before a byte is read), as the first, a middle one (then also deleting the dead daemon's replica folder, as
its node's next daemon does) and the last of the read pieces is checked."""


def test_the_daemon_killed_mid_restore_never_yields_wrong_bytes(start_daemons: Callable[..., list[DaemonProc]]
                                                                ) -> None:
    """A trainer restores ~16 MB from the daemon's memory into its own tensors, in 15 read pieces, and SIGKILLs the
    daemon at one point of it (one daemon per point, side by side). Each restore raises a DatastatesError, or
    returns the state bitwise in ``into``'s own memory: never success with wrong bytes."""
    daemons = start_daemons(*({"chunk_size": f"{CHUNK}B"} for _ in KILL_POINTS))
    procs = []
    for d, point in zip(daemons, KILL_POINTS):
        run = d.root / point.replace("+", "-")  # the daemons share one root folder: a run folder each
        procs.append(subprocess.Popen([sys.executable, "-c", KILLER, d.endpoint, str(d.proc.pid), str(run), point,
                                       str(1 << 20)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for d, point, proc in zip(daemons, KILL_POINTS, procs):
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{point}: the trainer failed ({proc.returncode}):\n{err[-3000:]}"
        got = json.loads(out.strip().splitlines()[-1])
        assert got["killed"] == [point], f"{point}: the daemon was not killed where meant: {got}"
        assert got["replica"], f"{point}: the restore never opened the daemon's replica: {got}"
        assert d.proc.wait(60) == -9
        if "raised" in got:
            assert issubclass(getattr(errors, got["raised"], Exception), errors.DatastatesError), got
            continue
        assert got["same"] and got["step"] == 5, f"{point}: {got}"
        assert got["unequal"] == [] and got["moved"] == [], f"{point}: returned with wrong bytes: {got}"
        assert got["pieces"] == PIECES, f"{point}: {got}"


# -- 5. awkward layouts --------------------------------------------------------------------------


def test_views_sharing_one_storage_stay_shared_and_get_the_values(trainer: Client, run: Path) -> None:
    torch.manual_seed(6)
    t = torch.randn(1000)
    path = committed(trainer, {"t": t, "v": t[2:]}, run)
    base = torch.zeros(1000)
    shared = {"t": base, "v": base[2:]}
    datastates.load(path, into=shared)
    assert_tensor_bitwise(t, shared["t"], "t")
    assert same_storage(shared["t"], shared["v"]) and shared["v"].data_ptr() == base.data_ptr() + 8
    apart = {"t": torch.zeros(1000), "v": torch.zeros(998)}
    ptrs = identities(apart)
    datastates.load(path, into=apart)
    assert_tensor_bitwise(t, apart["t"], "t")
    assert_tensor_bitwise(t[2:].contiguous(), apart["v"], "v")
    assert identities(apart) == ptrs


def test_an_into_tensor_that_overlaps_itself_is_a_misfit_not_a_corrupt_file(trainer: Client, run: Path) -> None:
    """An expanded tensor in ``into`` (stride 0: its elements share memory) cannot hold the file's distinct values:
    StateMismatchError naming it before anything is written, never the sound file called corrupt after ``a`` was."""
    torch.manual_seed(16)
    path = committed(trainer, {"a": torch.randn(4, 3), "x": torch.randn(4, 3)}, run)
    into = {"a": torch.zeros(4, 3), "x": torch.zeros(3).expand(4, 3)}
    with pytest.raises(StateMismatchError, match=r"\['x'\]"):
        datastates.load(path, into=into)
    assert torch.equal(into["a"], torch.zeros(4, 3))


def test_an_into_tensor_whose_rows_overlap_is_a_misfit(trainer: Client, run: Path) -> None:
    """A tensor of ``into`` whose strides make rows share memory (``as_strided``, no stride of 0) cannot hold the file's
    distinct values either: StateMismatchError naming it before anything is written. torch's copy does not refuse
    it (its overlap check gives up on such strides), so the load returned success with later rows written over
    earlier ones."""
    torch.manual_seed(19)
    path = committed(trainer, {"a": torch.randn(4, 3), "x": torch.randn(4, 4)}, run)
    into = {"a": torch.zeros(4, 3), "x": torch.zeros(16).as_strided((4, 4), (2, 1))}
    with pytest.raises(StateMismatchError, match=r"\['x'\]"):
        datastates.load(path, into=into)
    assert torch.equal(into["a"], torch.zeros(4, 3)) and int(torch.count_nonzero(into["x"])) == 0


def test_strided_tensors_in_the_file_and_in_into(trainer: Client, run: Path) -> None:
    """A transposed tensor in the file into a contiguous one, and a contiguous one into a transposed one: values
    by index, ``into``'s strides and memory kept."""
    torch.manual_seed(7)
    state = {"ft": torch.randn(300, 70).t(), "c": torch.randn(70, 300)}
    path = committed(trainer, state, run)
    into = {"ft": torch.zeros(70, 300), "c": torch.zeros(300, 70).t()}
    ptrs = identities(into)
    datastates.load(path, into=into)
    assert identities(into) == ptrs
    assert into["ft"].is_contiguous() and into["c"].stride() == (1, 70)
    for k in state:
        assert torch.equal(into[k], state[k]), k


def test_one_tensor_under_two_keys_into_two_tensors(trainer: Client, run: Path) -> None:
    """The same tensor object saved under two keys (one entry of the file), restored into two tensors of their own:
    both get the values, each in its own memory."""
    torch.manual_seed(15)
    t = torch.randn(4096)
    path = committed(trainer, {"a": t, "b": t}, run)
    into = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
    ptrs = identities(into)
    datastates.load(path, into=into)
    assert identities(into) == ptrs
    assert_tensor_bitwise(t, into["a"], "a")
    assert_tensor_bitwise(t, into["b"], "b")


@pytest.mark.parametrize("into_tied", [True, False], ids=["tied", "untied"])
def test_tied_weights(into_tied: bool, trainer: Client, run: Path) -> None:
    """A model whose head shares the embedding's weight (two keys, one tensor) saved; restored into a tied model
    (stays tied) and into an untied one (both get the values)."""
    saved = net(8, tied=True).state_dict()
    assert same_storage(saved["emb.weight"], saved["head.weight"])  # the case under test
    path = committed(trainer, saved, run)
    model = net(9, tied=into_tied)
    params = {k: p.data_ptr() for k, p in model.named_parameters()}
    datastates.load(path, into=model.state_dict())
    assert_state_equal(saved, model.state_dict())
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == params
    assert (model.head.weight is model.emb.weight) == into_tied


def test_empty_scalar_and_every_common_dtype(trainer: Client, run: Path) -> None:
    torch.manual_seed(10)
    state = {"empty": torch.zeros(0, 5), "scalar": torch.tensor(3.25, dtype=torch.float64),
             "bool": torch.rand(1001) > 0.5, "bf16": torch.randn(513).bfloat16(),
             "i64": torch.randint(-2**62, 2**62, (77,)),
             "c64": torch.randn(129, dtype=torch.complex64), "u8": torch.randint(0, 256, (3, 5), dtype=torch.uint8)}
    path = committed(trainer, state, run)
    into = zeros_like(state)
    ptrs = identities(into)
    datastates.load(path, into=into)
    assert_state_equal(state, into)
    assert identities(into) == ptrs


@pytest.mark.parametrize("how", ["memory", "storage"])
def test_parameters_that_require_grad_are_filled(how: str, trainer: Client, run: Path) -> None:
    """``into=dict(model.named_parameters())``: leaf tensors that require grad, filled with no autograd error, still
    leaves that require grad (from either source); a transposed one too (filled by a copy, not straight)."""
    saved = dict(net(11).named_parameters())
    saved["transposed"] = nn.Parameter(torch.randn(30, 20))
    path = committed(trainer, saved, run)
    if how == "storage":
        supersede(trainer, run)
    else:
        replica_of(trainer, path)
    model = net(12)
    model.transposed = nn.Parameter(torch.zeros(20, 30).t())
    into = dict(model.named_parameters())
    restored = trainer.restore(run, "rank0.pt", tag="step1", into=into)
    assert restored is not None and restored.source == how
    assert model.transposed.stride() == (1, 30)
    for k, p in model.named_parameters():
        assert p is into[k] and p.is_leaf and p.requires_grad and p.grad_fn is None, k
        assert torch.equal(p.detach(), saved[k].detach()), k


def test_tuples_namedtuples_and_plain_values(trainer: Client, run: Path) -> None:
    """Tensors inside tuples and namedtuples filled in place; ints, floats, strings and None are the file's."""
    torch.manual_seed(13)
    state = {"pair": (torch.randn(40), torch.arange(9)), "nt": NT(torch.randn(6, 2), 42),
             "plain": {"step": 1234, "lr": 3e-4, "name": "ckpt", "none": None, "list": [torch.randn(3), 7]}}
    path = committed(trainer, state, run)
    into = {"pair": (torch.zeros(40), torch.zeros(9, dtype=torch.int64)), "nt": NT(torch.zeros(6, 2), 0),
            "plain": {"step": 0, "lr": 0.0, "name": "", "none": "something", "list": [torch.zeros(3), 0]}}
    ptrs = identities(into)
    before = copy.deepcopy(into)
    with pytest.raises(errors.WeightsOnlyError, match="NT"):  # the skeleton is unpickled before anything is written
        datastates.load(path, into=into)
    assert_state_equal(before, into)
    with torch.serialization.safe_globals([NT]):
        out = datastates.load(path, into=into)
    assert out is into
    assert_state_equal(state, into)
    assert identities(into) == ptrs


# -- 6. many read pieces, storages straddling them ---------------------------------------------------


STRADDLING = (250_001, 833_333, 4097, 625_000, 17, 2_250_000)
"""float32 element counts: storages of odd sizes, so that read pieces and checksummed pieces end inside them."""


def straddling(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {f"t{i}": torch.randn(n) for i, n in enumerate(STRADDLING)}


def straddles(path: Path, piece: int) -> int:
    """How many storages of the file meet more than one read piece of ``piece`` bytes."""
    header, _, _, _ = file_index(path.read_bytes())
    return sum(rec.offset // piece != (rec.offset + rec.nbytes - 1) // piece for rec in header.storages)


@pytest.mark.parametrize("how", ["memory", "storage"])
def test_a_state_over_many_read_pieces(how: str, trainer: Client, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """~16 MB in 1 MiB read pieces (the reader's piece size lowered, which is a tuning constant; the daemon's
    pieces are 256 KiB): storages straddle read pieces and checksummed pieces, read by four threads."""
    state = straddling(14)
    path = committed(trainer, state, run)
    if how == "storage":
        supersede(trainer, run)
    else:
        replica_of(trainer, path)
    monkeypatch.setattr(stream_module, "READ_PIECE", 1 << 20)
    assert straddles(path, 1 << 20) >= 3  # the case under test
    into = zeros_at(state, DIRECT_PHASE)  # from disk, the large ones read with O_DIRECT straight into them
    ptrs = identities(into)
    restored = trainer.restore(run, "rank0.pt", tag="step1", into=into)
    assert restored is not None and restored.source == how
    assert identities(into) == ptrs
    for k, t in state.items():
        assert torch.equal(into[k], t), k


def test_a_state_over_the_default_read_piece(trainer: Client, run: Path) -> None:
    """~69 MB, over the reader's 64 MiB read piece as it ships: a storage straddles the two pieces."""
    state = {"head": torch.randn(1_000_000), "big": torch.randn(16_000_000), "tail": torch.randn(333)}
    path = committed(trainer, state, run)
    assert straddles(path, stream_module.READ_PIECE) == 1  # the case under test
    into = zeros_like(state)
    ptrs = identities(into)
    datastates.load(path, into=into)
    assert identities(into) == ptrs
    for k, t in state.items():
        assert torch.equal(into[k], t), k


def cached_pages(path: Path) -> int:
    """How many of ``path``'s pages the page cache holds (mincore(2) of a private mapping that touches none)."""
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert LIBC.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)


LIBC = ctypes.CDLL(None, use_errno=True)


@pytest.mark.parametrize("memory", ["aligned as the file", "not aligned as the file"])
def test_an_in_place_load_from_disk_leaves_the_file_out_of_the_page_cache(memory: str, trainer: Client,
                                                                          run: Path) -> None:
    """An in-place load into tensors that start where the file's storages do (64 bytes past a page, as torch
    allocates large tensors) reads them with O_DIRECT; into other tensors (here views 128 bytes into a buffer), it
    reads through the page cache, for the kernel's read-ahead, and then drops the file's pages (on a thread of its
    own, after it returned). Either way a node restoring hundreds of GB is left as an O_DIRECT read leaves it, not
    holding a second copy of the checkpoint beside the model's."""
    state = {"w": torch.randn(12_000_000), "b": torch.randn(1000)}
    path = committed(trainer, state, run)
    supersede(trainer, run)  # step1's replica dropped: the restore below reads storage
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert cached_pages(path) < 16  # the case under test: cold (the tail's few pages may stay)
    into = zeros_at(state, DIRECT_PHASE if memory == "aligned as the file" else DIRECT_PHASE + 128)
    got = trainer.restore(run, "rank0.pt", tag="step1", into=into)
    assert got is not None and got.source == "storage", got
    for k, t in state.items():
        assert torch.equal(into[k], t), k
    for _ in range(200):  # a hang guard: the drop runs after the load returned
        if cached_pages(path) < 16:
            break
        time.sleep(0.05)
    assert cached_pages(path) < 16, f"{cached_pages(path)} of the file's pages stay cached after the restore"


@pytest.mark.parametrize("how", ["tied", "overlapping"])
def test_into_tensors_sharing_memory_the_file_keeps_apart_are_a_misfit(
        how: str, trainer: Client, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tensors of ``into`` that share memory (a model tied where the checkpoint's was not; views that overlap)
    cannot hold two different tensors of the file: StateMismatchError naming the key before anything is written.
    It returned success with one memory holding pieces of both, as the read threads landed them."""
    monkeypatch.setattr(stream_module, "READ_PIECE", CHUNK)  # each tensor over many pieces, on every read thread
    torch.manual_seed(17)
    n = 1 << 20
    path = committed(trainer, {"a": torch.randn(n), "b": torch.randn(n)}, run)
    memory = torch.zeros(2 * n)
    into = {"a": memory[:n], "b": memory[:n] if how == "tied" else memory[n // 2:n // 2 + n]}
    with pytest.raises(StateMismatchError, match=r"\['b'\]"):
        datastates.load(path, into=into)
    assert int(torch.count_nonzero(memory)) == 0


def test_into_tied_as_the_file_is_but_with_other_strides(trainer: Client, run: Path) -> None:
    """One tensor under two keys in the file and in ``into``, ``into``'s transposed: not a misfit, both get the
    values (the check of shared memory compares how each side shares it, not ``into``'s strides with the file's)."""
    torch.manual_seed(18)
    t = torch.randn(64, 64)
    path = committed(trainer, {"a": t, "b": t}, run)
    w = torch.zeros(64, 64).t()
    into = {"a": w, "b": w}
    datastates.load(path, into=into)
    assert torch.equal(into["a"], t) and into["b"] is w
