"""Two saves of one DCP checkpoint at once (integrations/dcp.py, daemon/commit.py): one commits whole, one is refused.

A client's snapshots of a tag are one commit to its daemon, so two ``dcp.async_save`` calls to
one checkpoint_id with no gap used to mix their files: both futures resolved, and the marker
listed only ``metadata.pt``, or one save's ``rank0.pt`` with the other's metadata. Two
clients saving one checkpoint each refused a file of the other's, and neither committed.
Now a client's writer holds the tag while its save is under way, and the daemon refuses a
client's snapshot of a tag another client is saving there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from datastates.client import Client
from datastates.integrations.dcp import METADATA, DatastatesStorageReader, DatastatesStorageWriter, rank_file
from datastates.protocol.errors import CommitError, DatastatesError
from datastates.protocol.format import marker_name
from datastates.protocol.tags import read_marker

from conftest import DaemonProc
from test_multirank import free_port

HERE = Path(__file__).parent

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TRIALS = 40
"""Back-to-back pairs of saves; the race was lost in 31 of 40 (one client) and 1 to 5 of 40 (two clients)."""
LONG_TRIALS = 400
"""With ``--long``."""
MIXES = (("async_save", "async_save", 1), ("async_save", "save", 1), ("async_save", "async_save", 2),
         ("async_save", "save", 2), ("save", "save", 2))
"""(the first save's call, the second's, how many clients make them): ``save`` runs on a thread of its own, as a
checkpoint thread would, so the two overlap whatever the order."""
HOLD_S = 60
"""The longest a test waits for a save it holds back to reach the point it is held at."""


def state(n: int) -> dict[str, Any]:
    """A save's state: each save's of another shape, so a checkpoint that mixes two does not load as either."""
    return {"model": {"w": torch.full((n,), float(n))}, "step": n}


def loads_whole(folder: Path, n: int) -> str:
    """Why the checkpoint at ``folder`` is not ``state(n)``, whole: '' when it is (its marker lists one rank's file
    and the metadata, and DCP loads it into that state, bitwise)."""
    marker = read_marker(str(folder / marker_name(folder.name)))
    files = sorted(f.path for f in marker.files)
    if files != sorted([METADATA, rank_file(0)]):
        return f"its marker lists {files}"
    got = {"model": {"w": torch.zeros(n)}, "step": 0}
    try:
        dcp.load(got, checkpoint_id=str(folder), storage_reader=DatastatesStorageReader(), no_dist=True)
    except CheckpointException as exc:
        return f"it does not load as save {n}'s: {cause(exc)}"
    if not torch.equal(got["model"]["w"], state(n)["model"]["w"]) or got["step"] != n:
        return f"it loads {got['step']}, values {got['model']['w'].unique()[:4].tolist()}, not save {n}'s"
    return ""


def cause(exc: BaseException) -> BaseException:
    """What a DCP save failed of: the first rank's exception that DCP wraps, else ``exc`` itself."""
    if isinstance(exc, CheckpointException) and exc.failures:
        first = next(iter(exc.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return exc


@pytest.fixture
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2, thread_name_prefix="save") as pool:
        yield pool


def start(call: str, client: Client, n: int, folder: Path, threads: ThreadPoolExecutor,
          writer: DatastatesStorageWriter | None = None) -> Future:
    """One save of ``state(n)`` into ``folder`` through ``client``: ``async_save``'s future, or ``save`` on a thread."""
    kwargs = dict(checkpoint_id=str(folder), storage_writer=writer or DatastatesStorageWriter(client), no_dist=True)
    if call == "async_save":
        return dcp.async_save(state(n), **kwargs)
    return threads.submit(dcp.save, state(n), **kwargs)


def outcomes(saves: dict[int, Future]) -> tuple[list[int], dict[int, BaseException]]:
    """The saves that succeeded, and why each other one failed."""
    failed = {n: cause(f.exception(timeout=120)) for n, f in saves.items() if f.exception(timeout=120) is not None}
    return [n for n in saves if n not in failed], failed


def held(writer: DatastatesStorageWriter, method: str, before: Callable[[], None],
         after: Callable[[], None] = lambda: None) -> DatastatesStorageWriter:
    """``writer`` whose ``method`` calls ``before()`` first and ``after()`` once it returned or raised: a save held at
    a point of DCP's call order while another one goes on."""
    real = getattr(writer, method)

    def call(*args: Any, **kwargs: Any) -> Any:
        before()
        try:
            return real(*args, **kwargs)
        finally:
            after()

    setattr(writer, method, call)
    return writer


def never_finished(client: Client) -> DatastatesStorageWriter:
    """A writer whose save DCP never finishes, as when another rank's write failed: its write is sent, then fails."""
    writer = DatastatesStorageWriter(client)
    wrote_data = writer.write_data

    def written_then_failed(*args: Any) -> Any:
        wrote_data(*args)
        raise RuntimeError("another rank's write failed")

    writer.write_data = written_then_failed  # type: ignore[method-assign]
    return writer


@pytest.mark.parametrize("second", ["async_save", "save"])
def test_a_save_of_a_checkpoint_the_clients_async_save_is_still_writing_is_refused(
        second: str, daemon: DaemonProc, client: Client, threads: ThreadPoolExecutor) -> None:
    """An ``async_save`` is held before its metadata; a second save of its checkpoint_id through the same client is
    refused (CommitError) while it is; the first then commits whole. A save whose ``finish`` DCP never calls (another
    rank's write failed), and one refused in ``write_data``, leave the checkpoint to the next save on the thread
    that made them, and to any thread after it: each replaces it whole."""
    folder = daemon.root / "run" / "ckpt"
    wrote, go = threading.Event(), threading.Event()
    first = start("async_save", client, 1000, folder, threads,
                  held(DatastatesStorageWriter(client), "finish", lambda: (wrote.set(), go.wait(HOLD_S))))
    assert wrote.wait(HOLD_S)
    refused = start(second, client, 2000, folder, threads)
    try:
        with pytest.raises(CheckpointException) as told:
            refused.result(timeout=120)
        assert isinstance(cause(told.value), CommitError) and "still under way" in str(cause(told.value))
    finally:
        go.set()
    first.result(timeout=120)
    assert loads_whole(folder, 1000) == ""

    with pytest.raises(CheckpointException, match="another rank's write failed"):
        dcp.save(state(3000), checkpoint_id=str(folder), storage_writer=never_finished(client), no_dist=True)
    with pytest.raises(CheckpointException, match="both stored as"):  # refused in write_data, before a snapshot
        dcp.save({"w": torch.ones(2), "w@0": 1}, checkpoint_id=str(folder),
                 storage_writer=DatastatesStorageWriter(client), no_dist=True)
    dcp.save(state(4000), checkpoint_id=str(folder), storage_writer=DatastatesStorageWriter(client), no_dist=True)
    assert loads_whole(folder, 4000) == ""
    start(second, client, 5000, folder, threads).result(timeout=120)
    assert loads_whole(folder, 5000) == ""


def test_an_async_save_after_a_save_that_never_finished_commits(daemon: DaemonProc, client: Client) -> None:
    """A ``dcp.save`` whose ``finish`` DCP never calls (another rank's write failed) holds nothing once the thread
    that ran it begins an ``async_save`` of that checkpoint_id (whose write runs on DCP's thread): the retry commits
    whole, where it was refused as "still under way" for as long as the thread lived."""
    folder = daemon.root / "run" / "ckpt"
    with pytest.raises(CheckpointException, match="another rank's write failed"):
        dcp.save(state(1000), checkpoint_id=str(folder), storage_writer=never_finished(client), no_dist=True)
    dcp.async_save(state(2000), checkpoint_id=str(folder), storage_writer=DatastatesStorageWriter(client),
                   no_dist=True).result(timeout=120)
    assert loads_whole(folder, 2000) == ""


@pytest.mark.heavy
def test_a_save_again_after_the_coordinators_write_failed_never_commits_the_failed_saves_file(
        daemon: DaemonProc) -> None:
    """Two ranks: rank 0's write fails, rank 1's file is sent and its commit asked, and the coordinator never commits;
    the same save again is refused (CommitError) while rank 1's commit is not answered, and the checkpoint is never
    committed with rank 1's file of the failed save (it was: the second save's metadata beside it, not loading)."""
    folder = daemon.root / "run" / "ckpt"
    env = {**os.environ, "DATASTATES_ENDPOINT": daemon.endpoint, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), str(HERE / "dcp_failed_rank_job.py"),
                           str(folder)], env=env, capture_output=True, text=True, timeout=300)
    said = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]
    assert len(said) == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert all("No space left" in r["first"] for r in said), said
    assert all(r["again"].startswith("CommitError") and "not answered yet" in r["again"] for r in said), said
    assert not (folder / marker_name(folder.name)).exists(), loads_whole(folder, 20)


def test_two_clients_saving_one_checkpoint_at_once_commit_one_of_them_whole(
        start_daemon: Callable[..., DaemonProc], threads: ThreadPoolExecutor) -> None:
    """Client A's save has its ``rank0.pt`` taken and is held before its metadata; client B's save of the same
    checkpoint_id sends both its files, and its commit is held until A's is answered. B's ``rank0.pt`` is A's file;
    its ``metadata.pt`` is no file of A's yet, but of A's tag: refused too, so A's metadata is taken, A commits whole,
    and B is refused (it took ``metadata.pt``, and neither committed)."""
    d = start_daemon()
    folder = d.root / "run" / "ckpt"
    a_wrote, b_sent, a_answered = threading.Event(), threading.Event(), threading.Event()
    with Client(d.endpoint, timeout=60) as a, Client(d.endpoint, timeout=60) as b:
        real_commit = b.commit

        def b_commit(tag: str) -> Future:  # once B's snapshots are taken or refused, and A's commit answered
            try:
                b.wait()
            except DatastatesError:
                pass  # its rank0.pt is A's: refused, as it always was; its commit says so
            b_sent.set()
            a_answered.wait(HOLD_S)
            return real_commit(tag)

        b.commit = b_commit  # type: ignore[method-assign]
        writer_a = held(DatastatesStorageWriter(a), "finish", lambda: (a.wait(), a_wrote.set(), b_sent.wait(HOLD_S)),
                        a_answered.set)
        saves = {1000: start("async_save", a, 1000, folder, threads, writer_a)}
        assert a_wrote.wait(HOLD_S)
        saves[2000] = start("async_save", b, 2000, folder, threads)
        committed, failed = outcomes(saves)
    assert committed == [1000], {n: str(exc)[:300] for n, exc in failed.items()}
    assert isinstance(failed[2000], CommitError), failed[2000]
    assert loads_whole(folder, 1000) == ""


def test_back_to_back_saves_of_one_checkpoint_never_both_commit(start_daemon: Callable[..., DaemonProc],
                                                                  threads: ThreadPoolExecutor, long_runs: bool) -> None:
    """Pairs of saves of one checkpoint_id with no gap, each pair in a folder of its own, in every mix of
    ``async_save`` and ``save``, through one client or two: in every trial one save commits and the other is refused
    (CommitError), and the checkpoint loads whole as the one that committed."""
    d = start_daemon()
    wrong: list[str] = []
    with Client(d.endpoint, timeout=60) as a, Client(d.endpoint, timeout=60) as b:
        for trial in range(LONG_TRIALS if long_runs else TRIALS):
            first, second, clients = MIXES[trial % len(MIXES)]
            folder = d.root / "run" / f"ckpt{trial}"
            saves = {1000: start(first, a, 1000, folder, threads)}
            saves[2000] = start(second, a if clients == 1 else b, 2000, folder, threads)
            committed, failed = outcomes(saves)
            why = "" if len(committed) == 1 else f"{len(committed)} of the 2 committed"
            why = why or next((f"refused with {exc!r}" for exc in failed.values() if not isinstance(exc, CommitError)),
                              "") or loads_whole(folder, committed[0])
            if why:
                wrong.append(f"trial {trial} ({first}, {second}, {clients} client(s)): {why}"[:400])
    assert wrong == [], f"{len(wrong)} trial(s) wrong: {wrong[:5]}"
