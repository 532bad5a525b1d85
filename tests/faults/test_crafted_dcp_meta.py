"""Crafted DCP checkpoints: metadata whose every field that drives work is bounded, and files that lie about it.

DCP rebuilds a state from the metadata's ``planner_data`` (``datastatesctl convert --to
dcp``) and allocates each item at its size: a list index, a path's length or a size costs
work and memory in proportion to its value, so a few hundred bytes of JSON could cost
gigabytes. Each crafted field is refused naming it, before DCP sees it. A committed
checkpoint whose files do not hold what its metadata says is refused naming the item.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)

from datastates.client import Client
from datastates.integrations.dcp import (METADATA, DatastatesStorageReader, DatastatesStorageWriter, rank_file,
                                         to_filesystem)
from datastates.integrations.dcp_meta import MAX_DEPTH, MAX_DIMS, MAX_GAPS, ShardAt, decode, encode
from datastates.protocol.errors import CorruptCheckpointError, InvalidRequestError
from datastates.protocol.format import marker_name

from conftest import DATASTATESCTL, DaemonProc, save
from test_tiers import settle, tiers_cfg
from test_tiers import state as tiers_state


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test."""
    return shared_daemon_folder


def small_doc() -> dict[str, Any]:
    """The metadata JSON of ``{"w": a tensor of 3, "b": an object}``, both in rank 0's file."""
    md = Metadata({"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3]),
                                              [ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))]),
                   "b": BytesStorageMetadata()},
                  planner_data={"w": ("w",), "b": ("b",)},
                  storage_data={MetadataIndex("w", torch.Size([0])): ShardAt(rank_file(0), "w@0"),
                                MetadataIndex("b"): ShardAt(rank_file(0), "b")})
    return json.loads(encode(md))


def commit(d: DaemonProc, tag: str, doc: dict[str, Any], rank0: dict[str, Any]) -> Path:
    """A committed checkpoint folder of metadata ``doc`` and rank 0's file ``rank0``, as a crafter makes one."""
    folder = d.root / tag
    with Client(d.endpoint, timeout=60) as client:
        client.snapshot({"dcp": json.dumps(doc).encode()}, folder / METADATA)
        client.snapshot(rank0, folder / rank_file(0), tag=tag)
        client.commit(tag).result(timeout=120)
    return folder


def planner(**paths: list) -> Callable[[dict], None]:
    """The crafted ``planner_data``: item ``w`` at ``paths["w"]``, and the items ``paths`` adds."""
    def craft(doc: dict) -> None:
        for fqn in paths:
            if fqn not in doc["items"]:
                doc["items"][fqn] = {"bytes": True}
                doc["storage"].append([fqn, None, None, rank_file(0), "b"])
        doc["planner_data"].update(paths)
    return craft


def item_w(**fields: Any) -> Callable[[dict], None]:
    def craft(doc: dict) -> None:
        doc["items"]["w"].update(fields)
    return craft


CRAFTED: dict[str, tuple[Callable[[dict], None], str]] = {
    "a list index of 2^24 - 1": (planner(**{"a.16777215": ["a", 16777215]}),
                                 f"leave 16777215 list elements no item fills (at most {MAX_GAPS})"),
    "an index per nested list": (planner(**{f"a.{i}.999": ["a", i, 999] for i in range(2)}),
                                 "list elements no item fills"),
    "a path of 5000 keys": (planner(**{".".join(["a"] * 5000): ["a"] * 5000}),
                            f"has 5000 keys, not 1 to {MAX_DEPTH}"),
    "a path that is not its item's name": (planner(w=["v"]), "joined with dots make the item's name"),
    "a path inside another": (planner(w=["w"], **{"w.x": ["w", "x"]}), "ends at or inside another item's"),
    "names and indexes in one list": (planner(**{"a.0": ["a", 0], "a.x": ["a", "x"]}), "by name and by index"),
    "a path for no item": (lambda d: d["planner_data"].update(v=["v"]), "planner_data names 'v', which is no item"),
    "a size of 2^30 stored in 3 elements": (item_w(size=[1 << 30]), "item 'w' of size [1073741824] has chunks of "
                                                                    "fewer elements"),
    f"{MAX_DIMS + 1} dimensions": (item_w(size=[3] + [1] * MAX_DIMS,
                                          chunks=[[[0] * (MAX_DIMS + 1), [3] + [1] * MAX_DIMS]]),
                                   f"item 'w' has a size or offset of {MAX_DIMS + 1} dimensions (at most {MAX_DIMS})"),
}


@pytest.mark.parametrize("case", CRAFTED)
def test_each_crafted_field_that_drives_work_is_refused_naming_it(case: str, daemon: DaemonProc) -> None:
    """A committed checkpoint of each crafted metadata: the reader refuses it (CorruptCheckpointError naming the field)
    before DCP rebuilds or allocates anything from it. Before, a list index of 2^20 (320 bytes of JSON) cost
    `datastatesctl convert --to dcp` 10 s and 830 MiB, and a size of 2^30 wrote 4 GiB of zeros."""
    doc = small_doc()
    craft, says = CRAFTED[case]
    craft(doc)
    folder = commit(daemon, "crafted", doc, {"w@0": torch.ones(3), "b": b"x"})
    reader = DatastatesStorageReader()
    reader.reset(folder)
    with pytest.raises(CorruptCheckpointError, match="DCP metadata") as exc:
        reader.read_metadata()
    assert says in exc.value.message and str(folder) in exc.value.message, exc.value.message


def test_convert_to_dcp_of_no_checkpoint_says_so_in_one_line_and_to_filesystem_raises_the_error_itself(
        daemon: DaemonProc, tmp_path: Path) -> None:
    """`datastatesctl convert --to dcp` of a folder that holds no committed checkpoint is one line of error, exit
    status 2 (before: a warning of the missing marker and a 49-line traceback, DCP's CheckpointException being a
    BaseException); ``to_filesystem`` of a file that lacks an item its metadata names raises that error itself, not
    DCP's CheckpointException. (A crafted list index of 2^20 cost the command 10 s and 830 MiB before.)"""
    out = subprocess.run([DATASTATESCTL, "convert", str(tmp_path), "--to", "dcp", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert out.stderr.startswith("datastatesctl: error: ") and "is not a committed datastates DCP checkpoint" in \
        out.stderr, out.stderr[-2000:]
    lying = commit(daemon, "lying", small_doc(), {"w@0": torch.ones(3)})
    with pytest.raises(InvalidRequestError, match=f"{rank_file(0)} does not fit `into` at \\['b'\\]"):
        to_filesystem(lying, tmp_path / "lying")


def test_a_dcp_state_of_nested_lists_and_dicts_still_round_trips(daemon: DaemonProc, tmp_path: Path) -> None:
    """The bounds refuse nothing DCP itself saves: a state of lists of dicts, lists of ints and objects in a list
    converts to DCP's own layout and loads back from it."""
    state = {"model": {"layers": [{"w": torch.arange(6.0).reshape(2, 3)}, {"w": torch.ones(2, 3)}]},
             "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}], "state": {0: {"step": torch.tensor(3.0)}}},
             "mixed": [torch.zeros(2), 7], "name": "run"}
    folder = daemon.root / "nested"
    with Client(daemon.endpoint, timeout=60) as client:
        dcp.save(state, checkpoint_id=str(folder), storage_writer=DatastatesStorageWriter(client), no_dist=True)
    out = to_filesystem(folder, tmp_path / "dcp")
    got = {"model": {"layers": [{"w": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)}]},
           "optim": {"param_groups": [{"lr": 0.0, "params": []}], "state": {0: {"step": torch.tensor(0.0)}}},
           "mixed": [torch.ones(2), 0], "name": ""}
    dcp.load(got, checkpoint_id=out, no_dist=True)
    assert torch.equal(got["model"]["layers"][0]["w"], state["model"]["layers"][0]["w"])
    assert got["optim"]["param_groups"] == state["optim"]["param_groups"] and got["mixed"][1] == 7
    assert torch.equal(got["mixed"][0], torch.zeros(2)) and got["name"] == "run"


@pytest.mark.parametrize("stored", ["a tensor", "nothing"])
def test_a_resharded_load_of_an_object_the_file_does_not_hold_names_it(stored: str, daemon: DaemonProc) -> None:
    """The metadata says object ``b`` is in rank 0's file, which holds a tensor there, or nothing: a load of only
    ``b`` (a partial load, read as a resharded one) is refused naming the file and ``b`` (before: ``TypeError: a
    bytes-like object is required``, ``KeyError: 'b'``), as a load in the save's layout is."""
    rank0: dict[str, Any] = {"w@0": torch.ones(3)}
    if stored == "a tensor":
        rank0["b"] = torch.ones(2)
    folder = commit(daemon, "lying", small_doc(), rank0)
    for state in ({"b": None}, {"w": torch.zeros(3), "b": None}):
        with pytest.raises(CheckpointException) as exc:
            dcp.load(state, checkpoint_id=str(folder), storage_reader=DatastatesStorageReader(), no_dist=True)
        error = next(iter(exc.value.failures.values()))[0]
        assert isinstance(error, CorruptCheckpointError | InvalidRequestError), repr(error)
        assert "'b'" in str(error) and rank_file(0) in str(error), repr(error)


@pytest.mark.parametrize("side", ["save", "load"])
def test_a_checkpoint_id_of_none_is_refused_saying_so(side: str, daemon: DaemonProc) -> None:
    """``checkpoint_id=None`` (DCP then never calls ``reset``): refused saying a checkpoint_id is needed, not ``invalid
    tag ''`` from the daemon."""
    with Client(daemon.endpoint, timeout=60) as client, pytest.raises(CheckpointException) as exc:
        if side == "save":
            dcp.save({"w": torch.ones(3)}, checkpoint_id=None, storage_writer=DatastatesStorageWriter(client),
                     no_dist=True)
        else:
            dcp.load({"w": torch.ones(3)}, checkpoint_id=None, storage_reader=DatastatesStorageReader(client),
                     no_dist=True)
    assert "needs a checkpoint_id" in str(exc.value) and "invalid tag" not in str(exc.value), str(exc.value)[-2000:]


def test_decode_of_the_uncrafted_metadata_holds_both_items() -> None:
    assert set(decode(json.dumps(small_doc()).encode(), "m").state_dict_metadata) == {"w", "b"}


def test_a_restore_from_the_next_tier_on_a_node_whose_fast_tier_holds_nothing_warns_of_nothing(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A new node's fast tier holds no tag: every restore read the next tier's copy and logged "skipping the commit
    marker ...: No such file or directory", a warning for what is normal there. A marker others may write is still
    warned of."""
    d = start_daemon(**tiers_cfg(tmp_path))
    fast = tmp_path / "fast" / "run"
    with Client(d.endpoint, timeout=60) as client:
        save(client, tiers_state(1), fast / "step1" / "rank0.pt")
        settle(d)
        shutil.rmtree(fast / "step1")
        with caplog.at_level(logging.INFO, logger="datastates"):
            got = client.restore(fast, "rank0.pt")
        assert (got.tag, got.tier) == ("step1", "pfs") and torch.equal(got.state["w"], tiers_state(1)["w"])
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING], caplog.text[-2000:]
        (fast / "step1").mkdir()
        planted = fast / "step1" / marker_name("step1")
        shutil.copyfile(tmp_path / "pfs" / "run" / "step1" / marker_name("step1"), planted)
        planted.chmod(0o666)
        with caplog.at_level(logging.INFO, logger="datastates"):
            assert client.restore(fast, "rank0.pt").tier == "pfs"
    assert "skipping the commit marker" in caplog.text and "writable by group or others" in caplog.text, caplog.text
