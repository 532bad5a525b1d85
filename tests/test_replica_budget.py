"""The replica budget goes to the files that will be asked for (daemon/replica/table.py).

Real daemons with a small ``memory_restore_budget``; each rank file is 7 MiB, so a run of
three rank files saved twice holds 42 of 48 MiB (each file's replica and its spare). A run
that is over (its client gone, or gone on to another run folder) gives that room to the
next run's files, spares first and least recently used first, so a restart of a gone job
still finds its newest replicas, and a replica a restore is reading is never taken from it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

import datastates
from datastates.client import Client, Restored, daemon_status

from conftest import DaemonProc, assert_state_equal, save

MIB = 1 << 20
FILE = 7 * MIB


def state(run: str, step: int, rank: int, size: int = FILE) -> dict[str, Any]:
    """About ``size`` bytes, distinct per run, step and rank."""
    return {"w": torch.full((size // 4 - 1024,), float(step * 10 + rank)), "run": run, "step": step, "rank": rank}


def run(d: DaemonProc, name: str, steps: int, ranks: int = 3, size: int = FILE) -> None:
    """One client saves and commits ``steps`` tags of ``ranks`` rank files under run folder ``name``, then leaves."""
    with Client(d.endpoint, timeout=60) as c:
        for step in range(1, steps + 1):
            for rank in range(ranks):
                c.snapshot(state(name, step, rank, size), d.root / name / f"step{step}" / f"rank{rank}.pt")
            c.wait()
            c.commit(f"step{step}").result(timeout=120)
            settle(d)


def settle(d: DaemonProc) -> None:
    """Wait until the spares allocated ahead after a commit are there: a replica reserved while its own rank file's
    spare is still being allocated finds no room for both."""
    while replicas(d)["spares_allocating"]:
        time.sleep(0.05)


def replicas(d: DaemonProc) -> dict[str, Any]:
    return daemon_status(d.endpoint)["replicas"]


def held(d: DaemonProc, name: str) -> list[str]:
    """The committed replicas of run ``name``: its tag and rank file, each."""
    return sorted(f"{r['tag']}/{Path(r['path']).name}" for r in replicas(d)["replicas"]
                  if Path(r["path"]).parent.parent.name == name and r["committed"])


def restore(d: DaemonProc, name: str, rank: int) -> Restored:
    with Client(d.endpoint, timeout=60) as c:
        restored = c.restore(d.root / name, f"rank{rank}.pt")
    assert restored is not None
    return restored


def test_a_finished_runs_replicas_make_room_for_the_next_runs_files(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(memory_restore_budget="48MiB")
    run(d, "a", steps=2)
    before = replicas(d)
    assert len(held(d, "a")) == 3 and before["used_bytes"] > 41 * MIB, before["used_bytes"]
    run(d, "b", steps=2)  # three rank files again: all of a's room, in the end
    got = [restore(d, "b", rank) for rank in range(3)]
    assert [(r.tag, r.source) for r in got] == [("step2", "memory")] * 3, [r.why_not_memory for r in got]
    for rank, r in enumerate(got):
        assert_state_equal(state("b", 2, rank), r.state)
    now = replicas(d)
    assert held(d, "a") == [] and now["used_bytes"] <= now["budget_bytes"], (held(d, "a"), now["used_bytes"])
    assert now["released"] >= 6, now["released"]  # a's three spares and three replicas
    out = d.ctl("status").stdout
    assert "replicas: 3 held, 42.0 MiB of 48.0 MiB memory_restore_budget used" in out, out[:600]


def test_a_restarted_job_finds_its_newest_replicas_after_another_run_took_room(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Runs old, then a, end (their clients all gone) holding 42 of 48 MiB; run b's two rank files need 28 MiB: the
    three spares go first, then the least recently saved replica, old's, never a's: a's restart restores both its
    ranks from memory, and b does too."""
    d = start_daemon(memory_restore_budget="48MiB")
    run(d, "old", steps=2, ranks=1)
    run(d, "a", steps=2, ranks=2)
    run(d, "b", steps=2, ranks=2)
    got = {(name, rank): restore(d, name, rank) for name in ("a", "b") for rank in range(2)}
    assert {k: (r.tag, r.source) for k, r in got.items()} == {k: ("step2", "memory") for k in got}, \
        {k: r.why_not_memory for k, r in got.items()}
    for (name, rank), r in got.items():
        assert_state_equal(state(name, 2, rank), r.state)
    assert restore(d, "old", 0).source == "storage"
    assert replicas(d)["released"] == 4


def test_a_replica_being_read_by_a_restore_is_never_released(start_daemon: Callable[..., DaemonProc]) -> None:
    """Job a is gone and its restart reads its replica; meanwhile run b needs a's replica's room: b is refused it
    while the reader is connected, and gets it once the reader left."""
    d = start_daemon(memory_restore_budget="16MiB")
    run(d, "a", steps=2, ranks=1)  # a replica and a spare: 14 MiB
    big = 10 * MIB  # more than a's spare alone makes room for

    def read_while_b_saves(path: str) -> Any:
        run(d, "b", steps=1, ranks=1, size=big)
        return datastates.load(path)

    with Client(d.endpoint, timeout=60) as reader:
        got = reader.restore_with(d.root / "a", "rank0.pt", read_while_b_saves)
        assert got is not None and (got.tag, got.source) == ("step2", "memory"), got
        assert_state_equal(state("a", 2, 0), got.state)
        assert held(d, "b") == []
    run(d, "c", steps=1, ranks=1, size=big)  # the reader left: a's replica gives its room
    got_c = restore(d, "c", 0)
    assert (got_c.tag, got_c.source) == ("step1", "memory"), got_c.why_not_memory
    assert held(d, "a") == []


def test_a_process_that_went_on_to_another_run_folder_frees_the_old_ones_replicas(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """One process saves run a, then run b, and stays: a's replicas go once b has begun a second tag."""
    d = start_daemon(memory_restore_budget="16MiB")
    with Client(d.endpoint, timeout=60) as c:
        for name, steps in (("a", 2), ("b", 3)):
            for step in range(1, steps + 1):
                save(c, state(name, step, 0), d.root / name / f"step{step}" / "rank0.pt")
                settle(d)
        got = c.restore(d.root / "b", "rank0.pt")
    assert got is not None and (got.tag, got.source) == ("step3", "memory"), got.why_not_memory
    assert_state_equal(state("b", 3, 0), got.state)
    assert held(d, "a") == [], held(d, "a")


def test_a_client_saving_run_folders_in_turn_keeps_their_replicas(start_daemon: Callable[..., DaemonProc]) -> None:
    """One client saves three run folders in turn, each under a tag of its own (each rank file once every three
    tags), holding 42 of 48 MiB; another client's file finds no room each step: it is refused a replica, and the
    three keep theirs, none released as no longer saved."""
    d = start_daemon(memory_restore_budget="48MiB")
    names = ("x", "y", "z")
    with Client(d.endpoint, timeout=60) as c, Client(d.endpoint, timeout=60) as other:
        for step in range(1, 4):
            for name in names:
                save(c, state(name, step, 0), d.root / name / f"{name}{step}" / "rank0.pt")
                settle(d)
            save(other, state("o", step, 0), d.root / "o" / f"o{step}" / "rank0.pt")
            settle(d)
        got = {name: c.restore(d.root / name, "rank0.pt") for name in names}
    assert {n: (r.tag, r.source) for n, r in got.items()} == {n: (f"{n}3", "memory") for n in names}, \
        {n: r.why_not_memory for n, r in got.items()}
    assert replicas(d)["released"] == 0, replicas(d)["released"]
