"""Limits a user meets at ``snapshot()``, never later: tag and file-name lengths, and leaves torch keeps for itself.

A tag names its markers and a file is written under a longer temporary name first, so
both have limits below the file system's 255 bytes. Found too late, they failed the
commit ("File name too long") or ``wait()``, after the trainer had moved on.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import InvalidRequestError, PathNotAllowedError
from datastates.protocol.format import FILE_NAME_MAX, TAG_MAX
from datastates.protocol.paths import PATH_MAX, longest_derived

from conftest import DaemonProc, RawPeer, assert_state_equal, save


def test_a_tag_too_long_for_its_markers_is_refused_at_snapshot_and_the_longest_one_commits(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    folder = shared_daemon.root / "limits"
    with pytest.raises(InvalidRequestError, match=f"1-{TAG_MAX} characters"):
        shared_client.snapshot({"t": torch.ones(4)}, folder / "m.pt", tag="t" * (TAG_MAX + 1))
    longest = "t" * TAG_MAX
    state = {"t": torch.arange(8.0)}
    save(shared_client, state, folder / longest / "m.pt", tag=longest)
    assert datastates.latest(folder) == longest
    assert_state_equal(state, datastates.load(folder / longest / "m.pt"))


def test_a_file_name_too_long_for_its_temporary_name_is_refused_at_snapshot_and_the_longest_one_commits(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    folder = shared_daemon.root / "names" / "step1"
    with pytest.raises(PathNotAllowedError, match=f"longer than {FILE_NAME_MAX}"):
        shared_client.snapshot({"t": torch.ones(4)}, folder / ("m" * (FILE_NAME_MAX + 1)), tag="step1")
    path = folder / ("m" * FILE_NAME_MAX)
    state = {"t": torch.arange(8.0)}
    save(shared_client, state, path, tag="step1")
    assert_state_equal(state, datastates.load(path))


def deep_path(root: Path, tag: str, derived: int) -> Path:
    """A file in folder ``tag`` deep under ``root`` whose longest derived name (marker, staging copy, temporary
    names: ``longest_derived``) is ``derived`` bytes long: folders of 100 bytes, then a file name that makes it up."""
    folder = str(root / "deep")

    def base() -> int:
        return longest_derived(f"{folder}/{tag}/{'m' * 100}", tag) - 100  # a name of 100 is the longest written one

    while derived - base() > FILE_NAME_MAX:
        folder += "/" + "d" * 100
    return Path(folder) / tag / ("m" * (derived - base() - 3) + ".pt")


def test_a_path_whose_marker_would_pass_path_max_is_refused_at_snapshot_and_the_longest_one_commits(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    """A path of some 4,000 bytes fits, but its tag's marker (its name, beside it) or a re-save's staging copy
    may not: such a tag committed, and no reader ever found it. The client refuses it before sending anything,
    and the daemon refuses it from a raw client too; the longest path that fits commits and is found."""
    root = shared_daemon.root / "near-path-max"
    over = deep_path(root, "step", PATH_MAX)
    far = str(over.parent)  # a file path of 4,090 bytes
    while len(far) + len("/m.pt") < 4090:
        far += "/" + "d" * min(100, 4090 - len("/m.pt") - len(far) - 1)
    for path in (over, Path(far) / "m.pt"):  # one byte over, and far over
        with pytest.raises(PathNotAllowedError, match="PATH_MAX"):
            shared_client.snapshot({"t": torch.ones(4)}, path, tag="step")
    assert not root.exists(), "the client sent the refused snapshot"

    peer = RawPeer(shared_daemon.endpoint)
    try:
        peer.request("hello", {"pid": os.getpid(), "name": "raw"})
        snapshot = {"path": str(over), "tag": "step", "sources": [], "root": 0,
                    "entries": [{"provider": "pickle", "name": "<skeleton>", "meta": {"data": b"N."}}]}
        _, body = peer.request("snapshot", snapshot, msg_id=2)
    finally:
        peer.close()
    assert body["code"] == "path_not_allowed" and "PATH_MAX" in body["message"], body
    assert not over.parent.exists()

    fits = deep_path(root, "step", PATH_MAX - 1)
    state = {"t": torch.arange(8.0)}
    save(shared_client, state, fits, tag="step")
    assert datastates.latest(fits.parent.parent) == "step"
    assert_state_equal(state, datastates.load(fits))


def test_a_path_whose_copy_on_a_slower_tier_would_pass_path_max_is_refused_at_snapshot(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """The slower tier's folder is 200 bytes longer than the first's: a path that fits on the first tier but
    whose copy on the slower one would not is refused, naming that tier; one that fits on both commits."""
    fast, slow = tmp_path / "fast", tmp_path / ("pfs" + "s" * 197)
    d = start_daemon(storage={"tiers": [{"name": "fast", "path": str(fast), "shared": False},
                                        {"name": "pfs", "path": str(slow)}]}, memory_restore="none")
    with Client(d.endpoint, timeout=60) as c:
        with pytest.raises(PathNotAllowedError, match="on tier 'pfs'.*PATH_MAX"):
            c.snapshot({"t": torch.ones(4)}, deep_path(fast / "run", "step", PATH_MAX - 150), tag="step")
        fits = deep_path(fast / "run", "step", PATH_MAX - 1 - 200)
        state = {"t": torch.arange(8.0)}
        save(c, state, fits, tag="step")
    assert datastates.latest(fits.parent.parent) == "step"
    assert_state_equal(state, datastates.load(fits))


def test_nested_tensors_and_a_lazy_modules_state_round_trip_as_torch_save_keeps_them(
        shared_daemon: DaemonProc, shared_client: Client) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype API
        nested = torch.nested.nested_tensor([torch.arange(2.0), torch.arange(3.0)])
    state: dict[str, Any] = {"nested": nested, "lazy": torch.nn.LazyLinear(4).state_dict(), "w": torch.ones(3)}
    path = shared_daemon.root / "leaves" / "model.pt"
    save(shared_client, state, path)
    loaded = datastates.load(path, weights_only=False)
    assert loaded["nested"].is_nested
    for got, want in zip(loaded["nested"].unbind(), nested.unbind()):
        assert torch.equal(got, want)
    assert isinstance(loaded["lazy"]["weight"], torch.nn.parameter.UninitializedParameter)
    assert torch.equal(loaded["w"], state["w"])
