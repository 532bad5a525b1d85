"""Overload: snapshots faster than storage. No file ever holds a mix of two steps.

The daemon copies from the trainer's tensors into its own pool chunks, and a chunk is
reused only once it is written, so a flush never reads memory that a newer snapshot
fills (where DLRover PR #1585 and pytorch#144657 lost data). What the trainer owes is the
fence: nothing changes in place before ``wait()``. The policy decides what a new tag does
while an older one is still pending: ``block`` (the default) takes it, and its copy waits
for pool chunks; ``skip`` drops the new tag with a warning, so the trainer never waits.
"""

from __future__ import annotations

import logging
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client
from datastates.protocol.errors import InvalidRequestError, SnapshotSkippedError

from conftest import DaemonProc

STEPS = 8


def stepped_state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.zeros(2 << 20) for i in range(4)}  # 32 MiB


def assert_uniform(path: object, step: int) -> None:
    """Every element of every tensor is ``step``: the file holds one step, not a mix."""
    loaded = datastates.load(path)
    for name, t in loaded.items():
        mixed = int((t != step).sum())  # counted outside the assert: pytest would explain a tensor comparison
        assert mixed == 0, f"{path}: {name} has {mixed} elements of another step: {t.unique()[:8].tolist()}"


def test_block_writes_every_step_whole_through_a_tiny_pool(start_daemon: Callable[..., DaemonProc]) -> None:
    """Every step checkpointed into a pool an eighth of one snapshot: copies wait on flushes, nothing mixes."""
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB")
    state = stepped_state()
    with Client(d.endpoint, timeout=120) as c:
        commits = []
        for step in range(1, STEPS + 1):
            c.wait()  # the fence, as protect() puts it before optimizer.step()
            for t in state.values():
                t.fill_(step)
            c.snapshot(state, d.root / f"step{step}" / "model_states.pt")
            commits.append(c.commit(f"step{step}"))
        for fut in commits:
            fut.result(timeout=300)
    for step in range(1, STEPS + 1):
        assert_uniform(d.root / f"step{step}" / "model_states.pt", step)
    assert datastates.latest(d.root) == f"step{STEPS}"


def test_skip_drops_a_tag_while_an_older_one_is_pending(
    start_daemon: Callable[..., DaemonProc], caplog: pytest.LogCaptureFixture
) -> None:
    d = start_daemon(host_memory="4MiB", chunk_size="1MiB")
    state = stepped_state()
    with Client(d.endpoint, timeout=120, on_busy="skip") as c:
        for t in state.values():
            t.fill_(1)
        first = c.snapshot(state, d.root / "step1" / "model_states.pt")
        second = c.snapshot(state, d.root / "step2" / "model_states.pt")  # step1 is still copying
        second_optim = c.snapshot({"m": torch.ones(4)}, d.root / "step2" / "optim_states.pt")
        with caplog.at_level(logging.WARNING, logger="datastates.client.inflight"):
            c.wait()
        assert first.skipped == ""
        assert "step1" in second.skipped and "still" in second.skipped
        assert second_optim.skipped  # a tag is skipped whole, never in part
        assert "skipped the snapshot" in caplog.text
        c.commit("step1").result(timeout=120)
        with pytest.raises(SnapshotSkippedError, match="step2.*skipped"):
            c.commit("step2").result(timeout=120)

        for t in state.values():  # step1 is durable now: the next tag is taken again, all its files
            t.fill_(3)
        c.snapshot(state, d.root / "step3" / "model_states.pt")
        c.snapshot({"m": torch.ones(4)}, d.root / "step3" / "optim_states.pt")
        c.wait()
        assert sorted(c.commit("step3").result(timeout=120).files) == sorted(
            str(d.root / "step3" / n) for n in ("model_states.pt", "optim_states.pt"))
    assert_uniform(d.root / "step1" / "model_states.pt", 1)
    assert_uniform(d.root / "step3" / "model_states.pt", 3)
    assert not (d.root / "step2").exists()
    assert datastates.latest(d.root) == "step3"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="on_busy"):
        Client("ipc:///nonexistent/datastatesd.sock", on_busy="drop")


def test_the_local_fallback_is_refused_for_many_ranks() -> None:
    """Ranks saving alone could not commit a tag together: one rank's marker would name a partial tag."""
    from datastates.protocol.descriptors import Ranks

    with pytest.raises(InvalidRequestError, match="jobs of one rank"):
        Client("ipc:///nonexistent/datastatesd.sock", fallback="local", ranks=Ranks(world_size=2, local_world_size=2))
