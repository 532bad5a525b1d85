"""Restoring from the daemon's memory: a killed trainer's restart reads no storage, and never mixes steps.

The trainer is a real process, killed with SIGKILL; the restart is a new Client. To show
that a memory restore reads nothing from storage, the storage copy is damaged (same size,
so its marker still holds) before the restore: the state must come back bitwise anyway,
while loading the storage file fails its checksum.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.descriptors import Ranks
from datastates.protocol.errors import CommitError, CorruptCheckpointError, InvalidRequestError
from datastates.protocol.format import CommitMarker, marker_name

from conftest import DATASTATESCTL, DaemonProc, assert_state_equal, at_first_open, removed_but_mapped, save

TRAINER = """
import sys, time, torch
from datastates.client import Client
root, steps, commit_last = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
with Client(sys.argv[4], timeout=60) as c:
    for step in range(1, steps + 1):
        torch.manual_seed(step)
        state = {"w": torch.randn(300_000), "b": torch.randn(77).to(torch.bfloat16), "step": step}
        c.snapshot(state, f"{root}/step{step}/rank0.pt")
        c.wait()
        if step < steps or commit_last:
            c.commit(f"step{step}").result(timeout=120)
    print("READY", flush=True)
    time.sleep(600)
"""


def expected(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(300_000), "b": torch.randn(77).to(torch.bfloat16), "step": step}


def train_then_kill(d: DaemonProc, steps: int, commit_last: bool = True, trainer: str = TRAINER) -> None:
    """Run a trainer that checkpoints ``steps`` steps, then SIGKILL it, as a crash would."""
    proc = subprocess.Popen([sys.executable, "-c", trainer, str(d.root), str(steps), "1" if commit_last else "0",
                             d.endpoint], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def damage(path: Path) -> None:
    """Flip a byte mid-file, inside ``w``: the size (and so the commit marker) still holds, the checksum does not."""
    middle = path.stat().st_size // 2
    with open(path, "r+b") as f:
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_killed_trainer_restarts_from_the_daemons_memory_bitwise(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    train_then_kill(d, steps=2)
    damage(d.root / "step2" / "rank0.pt")
    with pytest.raises(CorruptCheckpointError):
        datastates.load(d.root / "step2" / "rank0.pt")
    with Client(d.endpoint, timeout=60) as c:
        restored = c.restore(d.root, "rank0.pt")
    assert restored is not None and (restored.tag, restored.source) == ("step2", "memory"), restored
    assert_state_equal(expected(2), restored.state)
    copies = daemon_status(d.endpoint)["replicas"]["replicas"]
    assert [(k["tag"], k["committed"]) for k in copies] == [("step2", True)]  # step1's copy went when step2 committed


def test_without_a_memory_copy_the_restore_reads_storage_and_says_so(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    train_then_kill(d, steps=2)
    d.stop()
    d2 = start_daemon()  # a new daemon holds nothing in memory
    with Client(d2.endpoint, timeout=60) as c:
        restored = c.restore(d2.root, "rank0.pt")
    assert restored is not None and (restored.tag, restored.source) == ("step2", "storage")
    assert "holds no replica" in restored.why_not_memory
    assert_state_equal(expected(2), restored.state)


def test_an_uncommitted_newer_snapshot_is_never_restored(start_daemon: Callable[..., DaemonProc]) -> None:
    """step3 was copied but never committed: every rank restores step2, from memory, not a mix of steps."""
    d = start_daemon()
    train_then_kill(d, steps=3, commit_last=False)
    assert datastates.latest(d.root) == "step2"
    with Client(d.endpoint, timeout=60) as c:
        restored = c.restore(d.root, "rank0.pt")
    assert restored is not None and (restored.tag, restored.source) == ("step2", "memory")
    assert_state_equal(expected(2), restored.state)


def test_ranks_agree_on_the_tag_when_only_one_fits_in_memory(start_daemon: Callable[..., DaemonProc]) -> None:
    """The budget holds one rank's file: rank 0 restores from memory, rank 1 from storage, both the same step."""
    d = start_daemon(memory_restore_budget="1MiB")
    states = {r: {"w": torch.full((150_000,), float(r)), "rank": r} for r in range(2)}  # 600 KB each
    clients = [Client(d.endpoint, timeout=60, ranks=Ranks(rank=r, local_rank=r, world_size=2, local_world_size=2,
                                                          job="j")) for r in range(2)]
    try:
        for r, c in enumerate(clients):
            c.snapshot(states[r], d.root / "step1" / f"rank{r}.pt")
            c.wait()
        for fut in [c.commit("step1") for c in clients]:
            fut.result(timeout=120)
        for r, c in enumerate(clients):
            c.snapshot({"w": torch.zeros(300_000), "rank": r}, d.root / "step2" / f"rank{r}.pt")  # never committed
        for c in clients:
            c.wait()
        restored = [c.restore(d.root, f"rank{r}.pt") for r, c in enumerate(clients)]
    finally:
        for c in clients:
            c.close()
    assert [(x.tag, x.source) for x in restored] == [("step1", "memory"), ("step1", "storage")]
    assert "holds no replica" in restored[1].why_not_memory
    for r in range(2):
        assert_state_equal(states[r], restored[r].state)


def test_memory_restore_none_turns_it_off(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(memory_restore="none")
    train_then_kill(d, steps=1)
    with Client(d.endpoint, timeout=60) as c:
        restored = c.restore(d.root, "rank0.pt")
    assert restored is not None and restored.source == "storage" and "memory_restore is none" in restored.why_not_memory
    assert_state_equal(expected(1), restored.state)


def test_restore_by_tag_returns_its_committed_version_never_a_newer_uncommitted_one(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Tag ``last`` is committed, then saved again and durable, but not committed: the daemon holds a replica of
    each version of that one path, same tag, same size. Restoring ``last`` gives the committed version, bitwise."""
    d = start_daemon()
    run = d.root / "run"
    path = run / "last" / "rank0.pt"
    with Client(d.endpoint, timeout=60) as c:
        save(c, expected(1), path, tag="last")
        newer = c.snapshot(expected(2), path, tag="last")
        c.wait()
        for _ in range(2400):  # a hang guard: until the new version and its replica are written
            if next(j for j in c.status()["snapshots"] if j["id"] == newer.id)["state"] == "durable":
                break
            time.sleep(0.05)
        held = [(r["tag"], r["committed"], r["size"]) for r in c.status()["replicas"]["replicas"] if r["path"] == str(path)]
        assert sorted(held) == [("last", False, held[0][2]), ("last", True, held[0][2])], held  # the case under test
        restored = c.restore(run, "rank0.pt", tag="last")
    assert restored is not None and (restored.tag, restored.source) == ("last", "memory"), restored
    assert_state_equal(expected(1), restored.state)
    assert_state_equal(expected(1), datastates.load(path))  # storage too still holds the committed version


def test_restore_refusals_are_clear(start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon()
    with Client(d.endpoint, timeout=60) as c:
        assert c.restore(d.root, "rank0.pt") is None  # nothing committed yet: a fresh start
        train_then_kill(d, steps=1)
        with pytest.raises(InvalidRequestError, match="not a file of tag 'step1'"):
            c.restore(d.root, "rank7.pt")
        with pytest.raises(CommitError, match="not committed"):
            c.restore(d.root, "rank0.pt", tag="step9")


def test_a_restore_racing_another_jobs_prune_reads_the_newest_committed_tag(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """A restore racing a prune, through ``Client.restore``: between its choice of step 3 and its open of step 3's
    file, another job commits step 4 and ``datastatesctl prune --keep-last 1`` deletes steps 1 to 3 (real processes,
    run by an audit hook on that open). The restore reads step 4 bitwise, never a raw FileNotFoundError."""
    d = start_daemon(memory_restore="none")  # from storage: the open the prune races
    run = d.root / "run"
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2, 3):
            save(c, expected(step), run / f"step{step}" / "rank0.pt")
        other = at_first_open(str(run / "step3" / "rank0.pt"), [sys.executable, "-c", (
            "import sys, torch\n"
            "from datastates.client import Client\n"
            "sys.path.insert(0, sys.argv[3])\n"
            "from conftest import save\n"
            "from test_restore import expected\n"
            "with Client(sys.argv[1], timeout=60) as c:\n"
            "    save(c, expected(4), sys.argv[2])\n"), d.endpoint, str(run / "step4" / "rank0.pt"),
            str(Path(__file__).parent)], [DATASTATESCTL, "prune", str(run), "--keep-last", "1"])
        restored = c.restore(run, "rank0.pt")
    assert [p.returncode for p in other] == [0, 0], other
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["step4"]
    assert restored is not None and (restored.tag, restored.source) == ("step4", "storage"), restored
    assert_state_equal(expected(4), restored.state)


def test_a_restarted_job_replaces_the_copies_of_the_run_it_restarts(start_daemon: Callable[..., DaemonProc]) -> None:
    """The restart has a new run id; once it commits, the crashed run's copy goes, so memory does not fill up."""
    d = start_daemon()
    train_then_kill(d, steps=1)
    with Client(d.endpoint, timeout=60, ranks=Ranks(job="restarted-run")) as c:
        restored = c.restore(d.root, "rank0.pt")
        assert restored is not None and (restored.tag, restored.source) == ("step1", "memory")
        c.snapshot(expected(2), d.root / "step2" / "rank0.pt")
        c.wait()
        c.commit("step2").result(timeout=120)
        copies = c.status()["replicas"]["replicas"]
    assert [(k["tag"], k["job"], k["committed"]) for k in copies] == [("step2", "restarted-run", True)]


RESIZING_TRAINER = """
import sys, time, torch
from datastates.client import Client
root, steps = sys.argv[1], int(sys.argv[2])
with Client(sys.argv[4], timeout=60) as c:
    for step in range(1, steps + 1):
        torch.manual_seed(step)
        c.snapshot({"w": torch.randn(200_000 + 150_000 * (step % 3 == 0)), "step": step}, f"{root}/step{step}/rank0.pt")
        c.wait()
        c.commit(f"step{step}").result(timeout=120)
    print("READY", flush=True)
    time.sleep(600)
"""


def test_replicas_written_over_the_last_ones_pages_restore_bitwise_and_hold_two_copies(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Each new replica is written over the pages of the one it replaced (its spare) instead of fresh ones:
    the restart still gets the newest step bitwise from a longer file cut to size, and /dev/shm holds the
    committed replica and one spare per rank file, never more."""
    d = start_daemon()
    train_then_kill(d, steps=5, trainer=RESIZING_TRAINER)
    # step 5 (200,000 floats) was written over step 3's replica (350,000): cut to size, or its load would fail
    torch.manual_seed(5)
    want = {"w": torch.randn(200_000), "step": 5}
    with Client(d.endpoint, timeout=60) as c:
        restored = c.restore(d.root, "rank0.pt")
    assert restored is not None and (restored.tag, restored.source) == ("step5", "memory"), restored
    assert_state_equal(want, restored.state)
    status = daemon_status(d.endpoint)["replicas"]
    files = sorted(os.listdir(status["folder"]))
    assert len(files) == 2 and sum(f.startswith("spare-") for f in files) == 1, files
    assert status["used_bytes"] == status["spare_bytes"] + sum(r["size"] for r in status["replicas"])
    assert all(r["in_place"] for r in status["replicas"]), "the copies did not fill the replica's pages themselves"


RESTORE_THEN_TRAIN = """
import sys, torch
from datastates.client import Client
root, endpoint = sys.argv[1], sys.argv[2]
with Client(endpoint, timeout=60) as c:
    restored = c.restore(root, "rank0.pt")
    assert restored.source == "memory", restored
    frozen = restored.state["w"]  # restored and never written: its pages are the replica's
    before = frozen.clone()
    for step in range(6, 10):  # more checkpoints: replicas come and go, spares are written over
        c.snapshot({"w": torch.full((200_000,), float(step)), "step": step}, f"{root}/step{step}/rank0.pt")
        c.wait()
        c.commit(f"step{step}").result(timeout=120)
    print("SAME" if torch.equal(frozen, before) else "CHANGED", flush=True)
"""


def test_a_restored_tensor_never_changes_when_later_replicas_reuse_pages(start_daemon: Callable[..., DaemonProc]) -> None:
    """A trainer restored from memory maps the replica copy-on-write; pages it never writes still show the file.
    The daemon must never write a later replica over a file it handed to a restore."""
    d = start_daemon()
    train_then_kill(d, steps=5, trainer=RESIZING_TRAINER)
    out = subprocess.run([sys.executable, "-c", RESTORE_THEN_TRAIN, str(d.root), d.endpoint],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "SAME", "a restored tensor changed under the trainer: its replica was written over"
    # the served replica was removed, not reused: the daemon's kept mapping of it went too (its pages are freed)
    removed = removed_but_mapped(d, daemon_status(d.endpoint)["replicas"]["folder"])
    assert not removed, f"the daemon still maps removed replicas: {removed}"


@pytest.mark.parametrize("budget", ["1536KiB", "8MiB"])
def test_a_re_saved_tag_restores_its_committed_version_and_keeps_no_older_replica(
        start_daemon: Callable[..., DaemonProc], budget: str) -> None:
    """A rolling tag ``last`` saved and committed again and again: every restore is the version its marker lists,
    and the daemon holds no replica of an older version. 1.5 MiB holds one 1 MB replica, not two, so every other
    version has none (its restore reads storage, never the older replica); 8 MiB would fill with old versions."""
    d = start_daemon(memory_restore_budget=budget)
    run = d.root / "run"
    path = run / "last" / "rank0.pt"
    sources = set()
    with Client(d.endpoint, timeout=60) as c:
        for step in range(1, 11):
            state = {"w": torch.full((250_000,), float(step)), "step": step}
            save(c, state, path, tag="last")
            restored = c.restore(run, "rank0.pt", tag="last")
            assert restored is not None
            got = (restored.source, restored.state["step"])  # never the state itself: no tensor in a failure
            assert got[1] == step, f"step {step} committed, restored {got}"
            assert_state_equal(state, restored.state)
            sources.add(restored.source)
        replicas = c.status()["replicas"]
    assert "memory" in sources, sources
    listed = CommitMarker.read(str(run / "last" / marker_name("last")))
    assert listed is not None
    held = [(r["snapshot"], r["committed"]) for r in replicas["replicas"]]
    assert held in ([], [(listed.files[0].snapshot, True)]), (held, listed.files[0].snapshot)
    assert replicas["used_bytes"] == replicas["spare_bytes"] + sum(r["size"] for r in replicas["replicas"])
    assert replicas["used_bytes"] <= 2 * path.stat().st_size, replicas  # the newest version's replica and one spare


def test_a_tag_saved_again_without_the_daemon_never_restores_the_daemons_older_replica(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    """``last`` committed through the daemon, then saved again by a trainer on its own (``fallback="local"``, no
    daemon): the daemon still holds its committed replica of the version before, same tag, path and size. The
    marker lists the new snapshot, so the restore reads storage, never that replica."""
    d = start_daemon()
    run = d.root / "run"
    path = run / "last" / "rank0.pt"
    with Client(d.endpoint, timeout=60) as c:
        save(c, {"w": torch.full((1000,), 1.0), "step": 1}, path, tag="last")
        with Client(f"ipc://{tmp_path}/no-daemon.sock", timeout=2, fallback="local") as local:
            assert local.local
            save(local, {"w": torch.full((1000,), 2.0), "step": 2}, path, tag="last")
        assert [r["committed"] for r in c.status()["replicas"]["replicas"]] == [True]  # the case under test
        restored = c.restore(run, "rank0.pt", tag="last")
    assert restored is not None
    assert (restored.source, restored.state["step"]) == ("storage", 2), restored.why_not_memory
    assert "another version" in restored.why_not_memory


def test_files_of_one_tag_in_sibling_folders_with_one_name_all_restore_from_memory(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """step1/model/rank0.pt and step1/optim/rank0.pt share a run folder and a name: committing the second file's
    replica must not retire the first's, which the same marker lists."""
    d = start_daemon()
    run = d.root / "run"
    states = {name: {"w": torch.full((1000,), float(i)), "i": i} for i, name in enumerate(("model", "optim"))}
    with Client(d.endpoint, timeout=60) as c:
        for name, state in states.items():
            c.snapshot(state, run / "step1" / name / "rank0.pt", tag="step1")
        c.wait()
        c.commit("step1").result(timeout=120)
        for name, state in states.items():
            restored = c.restore(run, f"{name}/rank0.pt")
            assert restored is not None and (restored.tag, restored.source) == ("step1", "memory"), (
                name, restored.why_not_memory)
            assert_state_equal(state, restored.state)


COUNT_FAULTS = """
import resource, sys
import datastates
state = datastates.load(sys.argv[1])  # the first load also imports what it needs: their pages fault too
del state
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
state = datastates.load(sys.argv[1])
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, state["w"].numel())
"""


def test_committed_replicas_stay_locked_so_a_global_drop_of_caches_leaves_restores_mapping_16_pages_a_fault(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """A global ``echo 3 > /proc/sys/vm/drop_caches`` flags every unlocked replica page for reclaim, and the kernel
    then maps those one per fault (a restore 2 x slower): the daemon locks each committed replica's pages (the
    newest per rank file, and the superseded one it keeps as a spare, whose lock passes to the next replica written
    over it), and a restore after the drop still maps about 16 pages per fault. Needs root (CAP_IPC_LOCK, and the
    drop)."""
    if os.geteuid() != 0 or not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        pytest.skip("needs root: locking replicas past RLIMIT_MEMLOCK, and a global drop of caches")
    d = start_daemon(memory_restore_budget="256MiB")
    elements = 16 << 20  # 64 MiB: 16,384 pages
    with Client(d.endpoint, timeout=60) as c:
        for step in (1, 2):
            save(c, {"w": torch.full((elements,), float(step))}, d.root / f"step{step}" / "rank0.pt")
    status = daemon_status(d.endpoint)["replicas"]
    (replica,) = [r for r in status["replicas"] if r["tag"] == "step2"]
    for _ in range(600):  # locked on the daemon's own thread, moments after the commit
        status = daemon_status(d.endpoint)["replicas"]
        if status["locked_bytes"] == replica["size"] + status["spare_bytes"] and not status["spares_allocating"]:
            break
        time.sleep(0.05)
    assert status["spare_bytes"] == replica["size"], status  # step1's replica, kept as the spare
    assert (status["locked_bytes"], status["lock_refused"]) == (2 * replica["size"], ""), status
    with open(f"/proc/{d.proc.pid}/status") as f:
        locked = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmLck:"))
    assert locked >= replica["size"], f"the daemon locks {locked} bytes, its replica is {replica['size']}"
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    out = subprocess.run([sys.executable, "-c", COUNT_FAULTS, replica["file"]], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    faults, numel = map(int, out.stdout.split())
    assert numel == elements
    pages = replica["size"] // 4096
    assert faults < pages // 4, f"{faults} page faults to map a replica of {pages} pages after a global drop of caches"


def test_a_served_replica_once_superseded_is_unlocked_not_kept_as_a_spare(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """A replica a trainer restored from may still be mapped there, so when a newer tag supersedes it, it is not
    kept as a spare: it goes, and its locked pages with it; locked memory holds the newest replica alone (the spare
    allocated in its stead is locked once a committed replica is written over it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: locking replicas past RLIMIT_MEMLOCK")
    d = start_daemon(memory_restore_budget="256MiB")
    elements = 4 << 20  # 16 MiB
    with Client(d.endpoint, timeout=60) as c:
        save(c, {"w": torch.full((elements,), 1.0)}, d.root / "step1" / "rank0.pt")
        served = c.restore(d.root, "rank0.pt")
        assert served is not None and (served.tag, served.source) == ("step1", "memory"), served
        save(c, {"w": torch.full((elements,), 2.0)}, d.root / "step2" / "rank0.pt")
    for _ in range(600):  # unlocked on the daemon's own thread, moments after the commit
        status = daemon_status(d.endpoint)["replicas"]
        if not status["locks_pending"] and not status["spares_allocating"]:
            break
        time.sleep(0.05)
    (replica,) = status["replicas"]
    assert replica["tag"] == "step2", status
    assert (status["locked_bytes"], status["lock_refused"]) == (replica["size"], ""), status  # a spare made anew is not


def test_a_replica_removed_under_the_daemon_is_unlocked_and_unmapped_by_the_next_snapshot(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """systemd's RemoveIPC or a /dev/shm clean-up deletes the daemon's replica folder: the locked pages of a replica
    no restore can use any more must not stay locked (and unswappable) until the daemon exits."""
    if os.geteuid() != 0:
        pytest.skip("needs root: locking replicas past RLIMIT_MEMLOCK")
    d = start_daemon(memory_restore_budget="512MiB")
    size = 0
    with Client(d.endpoint, timeout=60) as c:
        save(c, {"w": torch.full((8 << 20,), 1.0)}, d.root / "runA" / "step1" / "rank0.pt")
        for _ in range(600):
            size = daemon_status(d.endpoint)["replicas"]["locked_bytes"]
            if size:
                break
            time.sleep(0.05)
        assert size > 32 << 20, daemon_status(d.endpoint)["replicas"]
        folder = daemon_status(d.endpoint)["replicas"]["folder"]
        shutil.rmtree(folder)
        for step in (1, 2, 3):  # another run goes on: small snapshots, the last one removes a spare
            save(c, {"w": torch.full((1 << 10,), float(step))}, d.root / "runB" / f"step{step}" / "rank0.pt")
    assert not removed_but_mapped(d, folder), "the removed replica's pages are still mapped by the daemon"
    with open(f"/proc/{d.proc.pid}/status") as f:
        locked = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmLck:"))
    assert locked < size, f"the daemon still locks {locked} bytes; the removed replica had {size}"


def _settled_replicas(c: Client) -> dict:
    """The daemon's replica status once no spare is being allocated ahead."""
    for _ in range(1200):
        replicas = c.status()["replicas"]
        if not replicas["spares_allocating"]:
            return replicas
        time.sleep(0.05)
    raise AssertionError(f"a spare was still being allocated after 60 s: {replicas}")


@pytest.mark.parametrize("budget", ["8MiB", "2600KiB"], ids=["room-for-a-spare", "room-for-two-replicas-only"])
def test_a_first_replica_gets_a_spare_ahead_so_the_second_fills_existing_pages(
        start_daemon: Callable[..., DaemonProc], budget: str) -> None:
    """A rank file's first two replicas had no spare to be written over, so their fresh /dev/shm pages
    were allocated while their copies ran. Once the first is committed, a spare is allocated in the background:
    the second snapshot's copies fill its pages. Never where the budget lacks room for the spare and the next
    replica: that one must still be kept (2.6 MiB holds two 1 MB replicas, not three)."""
    d = start_daemon(memory_restore_budget=budget)
    run = d.root / "run"
    with Client(d.endpoint, timeout=60) as c:
        save(c, {"w": torch.full((250_000,), 1.0), "step": 1}, run / "step1" / "rank0.pt")
        after_first = _settled_replicas(c)
        save(c, {"w": torch.full((250_000,), 2.0), "step": 2}, run / "step2" / "rank0.pt")
        after_second = _settled_replicas(c)
        restored = c.restore(run, "rank0.pt")
    size = (run / "step1" / "rank0.pt").stat().st_size
    second = [r for r in after_second["replicas"] if r["tag"] == "step2"]
    assert restored is not None
    assert (restored.tag, restored.source) == ("step2", "memory"), (restored.tag, restored.source,
                                                                     restored.why_not_memory)
    assert restored.state["step"] == 2 and torch.equal(restored.state["w"], torch.full((250_000,), 2.0))
    assert len(second) == 1 and second[0]["committed"], after_second["replicas"]
    if budget == "8MiB":
        assert after_first["spare_bytes"] == size, after_first
        assert second[0]["in_place"], "the second replica was not written over the spare allocated ahead"
    else:
        assert after_first["spare_bytes"] == 0, after_first
    for replicas in (after_first, after_second):
        assert replicas["used_bytes"] == replicas["spare_bytes"] + sum(r["size"] for r in replicas["replicas"])
        assert replicas["used_bytes"] <= 2 * size, replicas
