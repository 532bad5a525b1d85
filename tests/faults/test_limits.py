"""Limits a user meets at ``snapshot()``, never later: tag and file-name lengths, and leaves torch keeps for itself.

A tag names its markers and a file is written under a longer temporary name first, so
both have limits below the file system's 255 bytes. Found too late, they failed the
commit ("File name too long") or ``wait()``, after the trainer had moved on.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import InvalidRequestError, PathNotAllowedError
from datastates.protocol.format import FILE_NAME_MAX, TAG_MAX

from conftest import DaemonProc, assert_state_equal, save


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
