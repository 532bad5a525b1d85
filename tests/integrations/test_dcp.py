"""DCP through datastates (integrations/dcp.py), with real ranks: FSDP2 and FSDP x TP saved from 4, loaded into 4, 2, 1.

One daemon for the module; tests/integrations/dcp_job.py saves once (``dcp.async_save`` and
``dcp.save`` through DatastatesStorageWriter, DCP's own FileSystemWriter beside them as the
reference), and each load job compares every local shard it loaded with DCP's own round trip.
The save takes an optimizer step right after ``async_save`` returns, so a fence that let it
through before the daemon copied the shards would show here as a load unequal to the reference.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

import datastates
from datastates.client import Client
from datastates.integrations.dcp import METADATA, DatastatesStorageReader, DatastatesStorageWriter, rank_file, to_filesystem
from datastates.integrations.dcp_meta import ShardAt, decode, encode
from datastates.protocol.errors import CommitError, CorruptCheckpointError, UnsupportedFormatError, WaitTimeout
from datastates.protocol.format import marker_name
from datastates.protocol.tags import read_marker

from conftest import DATASTATESCTL, DaemonFactory, DaemonProc, assert_state_equal
from test_multirank import free_port

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
CASES = ("fsdp", "2d")
TAGS = [f"{case}-step{n}" for case in CASES for n in (2, 3)]


def torchrun(d: DaemonProc, nproc: int, *args: str) -> tuple[subprocess.CompletedProcess, dict[int, dict[str, Any]]]:
    """dcp_job.py on ``nproc`` ranks against ``d``; each rank's RESULT lines, merged, by its rank."""
    env = {**os.environ, "DATASTATES_ENDPOINT": d.endpoint, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(BIN / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                           "--master-port", str(free_port()), str(HERE / "dcp_job.py"), str(d.root), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    results: dict[int, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            said = json.loads(line.split("RESULT ", 1)[1])
            results.setdefault(said["rank"], {}).update(said)
    return proc, results


Job = tuple[DaemonProc, subprocess.CompletedProcess, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def save_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    """A daemon, and the job's checkpoints saved from 4 ranks under its root; then the save rank 1 does not
    survive, which ends the job: torchrun's outcome and each rank's results."""
    factory = DaemonFactory(tmp_path_factory.mktemp("dcp"))
    d = factory.start()
    proc, results = torchrun(d, 4, "save")
    saved = [r for r, got in results.items() if got.get("fsdp") == got.get("2d") == "saved"]
    assert sorted(saved) == [0, 1, 2, 3], proc.stdout[-4000:] + proc.stderr[-4000:]
    yield d, proc, results
    factory.stop_all_later()


@pytest.fixture
def saved(save_job: Job) -> DaemonProc:
    return save_job[0]


def test_each_save_commits_one_tag_holding_every_ranks_file_and_the_metadata(saved: DaemonProc) -> None:
    """async_save's and save's tags are committed, each with the 4 ranks' files and DCP's metadata; ``latest`` names
    the last; each rank's file is a zip plain ``torch.load`` reads: its shards by key, and DCP's pickled objects."""
    for tag in TAGS:
        marker = read_marker(str(saved.root / tag / marker_name(tag)))
        assert sorted(f.path for f in marker.files) == sorted([METADATA, *(rank_file(r) for r in range(4))]), tag
    assert datastates.latest(saved.root) == TAGS[-1]
    shards = torch.load(saved.root / "fsdp-step2" / rank_file(1), weights_only=True)
    assert shards["model.blocks.0.up.weight@16,0"].shape == (16, 16), sorted(shards)[:8]  # rank 1's quarter of 64 rows
    assert all(isinstance(v, (torch.Tensor, bytes)) for v in shards.values())  # shards, and objects DCP pickled


@pytest.mark.parametrize("world", [4, 2])
def test_a_load_into_any_number_of_ranks_equals_dcps_own_round_trip(saved: DaemonProc, world: int) -> None:
    """FSDP over 4 ranks and FSDP 2 x TP 2, loaded into FSDP over ``world`` ranks (in place where the layout is the
    save's, resharded elsewhere): the model and AdamW state, the model alone, and one key alone, each equal on every
    rank to DCP's FileSystemWriter/FileSystemReader round trip of the same state. Into one process:
    ``test_dcp_to_torch_save_...`` (every item at its whole shape) and ``test_a_partial_load_...``."""
    proc, results = torchrun(saved, world, "load", *CASES)
    assert proc.returncode == 0 and sorted(results) == list(range(world)), proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank, result in results.items():
        for case in CASES:
            got = result[case]
            assert got["tensors"] > 0 and got["changed"], (rank, case, got)
            assert got["whole"] == [] and got["model_only"] == [] and got["one_key"] == [], (rank, case, got)


def test_a_partial_load_in_one_process_and_a_misfit_named(saved: DaemonProc) -> None:
    """Without torch.distributed (``no_dist``): one weight, whole, equals DCP's own; a state of another shape is
    refused naming the key."""
    ours, theirs = {"model": {"head.weight": torch.zeros(8, 16)}}, {"model": {"head.weight": torch.zeros(8, 16)}}
    dcp.load(ours, checkpoint_id=str(saved.root / "fsdp-step2"), storage_reader=DatastatesStorageReader(),
             no_dist=True)
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(saved.root / "ref-fsdp")), no_dist=True)
    assert torch.equal(ours["model"]["head.weight"], theirs["model"]["head.weight"])
    assert ours["model"]["head.weight"].count_nonzero() > 0
    with pytest.raises(CheckpointException, match="Size mismatch .* for model.head.weight"):  # DCP's planner's
        dcp.load({"model": {"head.weight": torch.zeros(9, 16)}}, checkpoint_id=str(saved.root / "fsdp-step2"),
                 storage_reader=DatastatesStorageReader(), no_dist=True)


def test_dcp_to_torch_save_of_the_converted_checkpoint_gives_what_it_gives_on_dcps_own(saved: DaemonProc,
                                                                                        tmp_path: Path) -> None:
    """``datastatesctl convert --to dcp`` (a load of every item into one process: 4 ranks' shards into whole tensors)
    writes DCP's own layout, which stock ``dcp_to_torch_save`` reads into the same state as from DCP's own
    checkpoint of it; the FSDP x TP checkpoint converts too."""
    out = tmp_path / "as-dcp"
    done = subprocess.run([DATASTATESCTL, "convert", str(saved.root / "fsdp-step2"), "--to", "dcp", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    dcp_to_torch_save(out, tmp_path / "ours.pt")
    dcp_to_torch_save(saved.root / "ref-fsdp", tmp_path / "theirs.pt")
    ours, theirs = (torch.load(tmp_path / n, weights_only=False) for n in ("ours.pt", "theirs.pt"))
    flat_ours, flat_theirs = flatten(ours), flatten(theirs)
    assert sorted(flat_ours) == sorted(flat_theirs)
    unequal = [k for k, v in flat_ours.items() if not (torch.equal(v, flat_theirs[k]) if isinstance(v, torch.Tensor)
                                                       else v == flat_theirs[k])]
    assert unequal == [], f"{len(unequal)} values differ, first {unequal[:4]}"
    assert to_filesystem(saved.root / "2d-step2", tmp_path / "again") == str(tmp_path / "again")


def flatten(state: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        out: dict[str, Any] = {}
        for k, v in state.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: state}


def test_the_reader_refuses_a_folder_that_is_not_a_committed_checkpoint(saved: DaemonProc, tmp_path: Path) -> None:
    """DCP's own layout is named as such; an empty folder (an interrupted save's) is refused as not committed."""
    reader = DatastatesStorageReader()
    reader.reset(saved.root / "ref-fsdp")
    with pytest.raises(CommitError, match="DCP's own layout; read it with FileSystemReader"):
        reader.read_metadata()
    reader.reset(tmp_path)
    with pytest.raises(CommitError, match="not a committed datastates DCP checkpoint"):
        reader.read_metadata()


def test_a_rank_killed_mid_save_leaves_nothing_visible_and_the_last_checkpoint_whole(save_job: Job) -> None:
    """Rank 1 is SIGKILLed once its shards reached the daemon: the job fails, the tag is never committed (the reader
    refuses it, ``latest`` still names the last one), and the last checkpoint still verifies file by file."""
    saved, proc, results = save_job
    assert proc.returncode != 0 and any(r.get("dying") for r in results.values()), proc.stdout[-4000:]
    assert datastates.latest(saved.root) == TAGS[-1]
    assert not (saved.root / "fsdp-killed" / marker_name("fsdp-killed")).exists()
    reader = DatastatesStorageReader()
    reader.reset(saved.root / "fsdp-killed")
    with pytest.raises(CommitError, match="not a committed"):
        reader.read_metadata()
    check = subprocess.run([DATASTATESCTL, "verify", str(saved.root / TAGS[-1])], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_resave_replaces_the_checkpoint_whole_and_a_daemon_killed_mid_save_leaves_it(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """``dcp.save`` in one process (``no_dist``) to one checkpoint_id three times: the second replaces the first
    (the re-save rule: switched whole at its commit); the daemon is SIGKILLed as the third's snapshot reaches it, so
    the save raises, and the second stays what the reader loads, bitwise, before and after the next daemon starts."""
    d = start_daemon()
    folder = d.root / "run" / "ckpt"

    def state(step: int) -> dict[str, Any]:
        torch.manual_seed(step)
        return {"model": {"w": torch.randn(1_000_000), "b": torch.randn(7)}, "step": step}

    def loaded() -> dict[str, Any]:
        got = {"model": {"w": torch.zeros(1_000_000), "b": torch.zeros(7)}, "step": 0}
        dcp.load(got, checkpoint_id=str(folder), storage_reader=DatastatesStorageReader(), no_dist=True)
        return got

    with Client(d.endpoint, timeout=60, liveness=3) as client:
        for step in (1, 2):
            dcp.save(state(step), checkpoint_id=str(folder), storage_writer=DatastatesStorageWriter(client),
                     no_dist=True)
            assert_state_equal(state(step), loaded())
        writer = DatastatesStorageWriter(client)
        sent = writer.write_data

        def write_then_kill(*args: Any) -> Any:
            fut = sent(*args)
            d.proc.kill()
            d.proc.wait()
            return fut

        writer.write_data = write_then_kill  # type: ignore[method-assign]
        with pytest.raises(CheckpointException, match="DaemonUnavailable|DaemonNotRunning"):
            dcp.save(state(3), checkpoint_id=str(folder), storage_writer=writer, no_dist=True)
    assert_state_equal(state(2), loaded())
    start_daemon()  # the next daemon's recovery removes what the killed one left
    assert_state_equal(state(2), loaded())


@dataclasses.dataclass
class Boom:
    """What a crafted metadata file names: unpickling it would run a command, which makes ``proof``."""

    proof: Path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.proof}",))


def crafted_metadata(how: str, proof: Path) -> dict[str, Any]:
    """A metadata file's dict as a crafter writes it."""
    if how == "pickled":  # as pickle.loads would run: the layout of no datastates
        return {"metadata": pickle.dumps(Boom(proof))}
    if how == "pickle where its JSON belongs":
        return {"dcp": pickle.dumps(Boom(proof))}
    index = MetadataIndex("w", torch.Size([0]))
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3]),
                                              [ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))])},
                  storage_data={index: ShardAt(rank_file(0), "w@0")})
    doc = json.loads(encode(md))
    doc["items"]["w"]["dtype"] = "load"  # torch.load: an attribute of torch, but no dtype
    return {"dcp": json.dumps(doc).encode()}


@pytest.mark.parametrize("how", ["pickled", "pickle where its JSON belongs", "a torch function for a dtype"])
def test_a_crafted_metadata_file_is_refused_and_runs_nothing(how: str, start_daemon: Callable[..., DaemonProc],
                                                             tmp_path: Path) -> None:
    """A committed folder whose metadata is pickled (which would run a command), is not JSON, or names a torch
    attribute that is no dtype: the reader refuses it, saying what, and runs nothing. The metadata is JSON, so no
    file can name a class or set an attribute."""
    d = start_daemon()
    folder = d.root / "run" / "crafted"
    with Client(d.endpoint, timeout=60) as client:
        client.snapshot(crafted_metadata(how, tmp_path / "ran"), folder / METADATA)
        client.snapshot({"w@0": torch.ones(3)}, folder / rank_file(0))
        client.commit("crafted").result(timeout=120)
    reader = DatastatesStorageReader()
    reader.reset(folder)
    error, message = {"pickled": (UnsupportedFormatError, "not DCP metadata"),
                      "pickle where its JSON belongs": (CorruptCheckpointError, "not JSON"),
                      "a torch function for a dtype": (CorruptCheckpointError, "'load', not a torch dtype")}[how]
    with pytest.raises(error, match=message):
        reader.read_metadata()
    assert not (tmp_path / "ran").exists()


def test_a_snapshot_expected_but_never_sent_fails_the_fence_once_instead_of_hanging(client: Client) -> None:
    """``async_save`` whose save thread fails before it sends its snapshot: the fence raises WaitTimeout once (at the
    client's timeout, or ``wait``'s), the next ``wait()`` goes on, and that snapshot, should its thread try to send
    it after all, is refused: the trainer was let go to change those tensors."""
    sent = client.expect()
    late = client.expect()
    with sent.sending():
        pass
    with pytest.raises(WaitTimeout, match="was not sent within 0.5 s"):
        client.wait(timeout=0.5)
    client.wait(timeout=0.5)
    with pytest.raises(WaitTimeout, match="not taken"):
        with late.sending():
            client.snapshot({"w": torch.ones(3)}, client.roots[0] + "/late/rank0.pt")
    assert client.status()["snapshots"] == []


def test_crafted_and_colliding_items_are_refused(start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """A state whose object key collides with a tensor chunk's stored key is refused at save; a committed checkpoint
    whose object runs code on unpickling is refused at load (torch's safe unpickler first), running nothing; one
    whose metadata names a file outside its tag is refused."""
    d = start_daemon()
    with Client(d.endpoint, timeout=60) as client:
        with pytest.raises(CheckpointException, match="both stored as 'w@0'"):
            dcp.save({"w": torch.arange(4.0), "w@0": "hello"}, checkpoint_id=str(d.root / "run" / "collide"),
                     storage_writer=DatastatesStorageWriter(client), no_dist=True)
        crafted = d.root / "run" / "crafted"
        dcp.save({"w": torch.arange(4.0), "obj": Boom(tmp_path / "ran")}, checkpoint_id=str(crafted),
                 storage_writer=DatastatesStorageWriter(client), no_dist=True)
    got = {"w": torch.zeros(4), "obj": None}
    with pytest.raises(CheckpointException, match="WeightsOnlyError|safe unpickler refuses"):
        dcp.load(got, checkpoint_id=str(crafted), storage_reader=DatastatesStorageReader(), no_dist=True)
    assert not (tmp_path / "ran").exists()
    reader = DatastatesStorageReader()
    reader.reset(crafted)
    metadata = reader.read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == "w")
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], file="../collide/rank0.pt")
    with pytest.raises(CorruptCheckpointError, match="not files of its committed tag"):
        reader.set_up_storage_reader(metadata, True)


def metadata_doc() -> dict[str, Any]:
    """The JSON of a small DCP metadata: a tensor of two chunks, an object, where each is stored."""
    chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([2])), ChunkStorageMetadata(torch.Size([2]), torch.Size([2]))]
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([4]), chunks),
                   "b": BytesStorageMetadata()},
                  planner_data={"w": ("w",), "b": ("b",)},
                  storage_data={MetadataIndex("w", torch.Size([0])): ShardAt(rank_file(0), "w@0"),
                                MetadataIndex("w", torch.Size([2])): ShardAt(rank_file(1), "w@2"),
                                MetadataIndex("b"): ShardAt(rank_file(0), "b")})
    return json.loads(encode(md))


CRAFTED = {
    "nested a million deep": (lambda d: "[" * 1_000_000, "not JSON"),
    "a size past 2^63": (lambda d: d["items"]["w"].update(size=[2**70]), "from 0 to 2"),
    "a chunk outside its size": (lambda d: d["items"]["w"]["chunks"][1].__setitem__(1, [3]), "outside its size"),
    "a chunk of other dimensions": (lambda d: d["items"]["w"]["chunks"][1].__setitem__(0, [2, 0]), "outside its size"),
    "a chunk stored nowhere": (lambda d: d["storage"].pop(1), "one to one"),
    "a storage row of no chunk": (lambda d: d["storage"].append(["w", [3], None, "rank1.pt", "w@3"]), "one to one"),
    "a chunk stored twice": (lambda d: d["storage"].append(list(d["storage"][0])), "twice"),
    "an empty planner path": (lambda d: d["planner_data"].update(w=[]), "planner_data"),
    "a negative index": (lambda d: d["planner_data"].update(w=["w", -3]), "planner_data"),
    "an index of 10^12": (lambda d: d["planner_data"].update(w=["w", 10**12]), "planner_data"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_crafted_metadata_values_that_do_not_fit_together_are_refused(case: str) -> None:
    """Each value of the metadata is checked against the others before DCP's planner sees it: what would make it
    raise a KeyError or IndexError, recurse, or fill a list of 10^12 items is CorruptCheckpointError naming it."""
    doc = metadata_doc()
    assert decode(json.dumps(doc).encode(), "m").storage_data  # the uncrafted one decodes
    craft, message = CRAFTED[case]
    raw = craft(doc)
    with pytest.raises(CorruptCheckpointError, match=message):
        decode((raw if isinstance(raw, str) else json.dumps(doc)).encode(), "m")
