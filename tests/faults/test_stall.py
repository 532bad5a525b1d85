"""I3, one outcome: a daemon stalled past the trainer's liveness never writes what the trainer gave up on.

The trainer's ``wait()`` raises DaemonUnavailable once the daemon has been silent for
``liveness`` seconds, and the trainer goes on and steps its optimizer. A daemon that was
only stopped (SIGSTOP here; swapping, a paused container or a hung NFS write in life)
used to resume, finish the copy from the changed memory and commit a torn file that
passed every checksum. Now both sides claim each snapshot's outcome through one atomic
decision (protocol/outcome.py): whatever ``wait()`` told the trainer is what the daemon does.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.client.connection import Connection
from datastates.client.reader.stream import verify
from datastates.protocol import messages as m
from datastates.protocol.errors import CommitError, DaemonUnavailable, DatastatesError, InvalidRequestError
from datastates.protocol.format import TEMP_SUFFIX
from datastates.protocol.paths import SHM_DIR

from conftest import DaemonProc

LIVENESS = 2.0
ELEMENTS = 128 << 20  # 512 MiB of float32: the copy through an 8 MiB pool takes a few hundred ms


def settled(d: DaemonProc) -> dict[str, Any]:
    """The daemon's status once it has nothing pending."""
    for _ in range(1200):
        status = daemon_status(d.endpoint, timeout=10)
        if not status["pending"] and not status["commits_pending"]:
            return status
        time.sleep(0.05)
    raise AssertionError(f"the daemon never settled: {status['snapshots']}")


def stalled_save(d: DaemonProc, path: Path, stop_after: float,
                 **client: Any) -> tuple[Client, torch.Tensor, bool, Future]:
    """snapshot + commit of step 1, SIGSTOP ``stop_after`` s later, then wait(), then step 2 as a trainer would.

    Returns the client, the tensor, whether ``wait()`` returned (True) or raised DaemonUnavailable (False),
    and the commit's future.
    """
    c = Client(d.endpoint, timeout=30, liveness=LIVENESS, **client)
    t = torch.full((ELEMENTS,), 1.0)
    c.snapshot({"t": t}, path, tag="step1")
    committed = c.commit("step1")
    time.sleep(stop_after)
    d.proc.send_signal(signal.SIGSTOP)
    try:
        c.wait()
        copied = True
    except DaemonUnavailable:
        copied = False
    t.fill_(2.0)  # the optimizer step, once wait() has returned or raised
    return c, t, copied, committed


@pytest.fixture
def stallable(start_daemon: Callable[..., DaemonProc]) -> Any:
    """A daemon with an 8 MiB pool, resumed (SIGCONT) at teardown whatever happened."""
    d = start_daemon(host_memory="8MiB", chunk_size="4MiB")
    yield d
    d.proc.send_signal(signal.SIGCONT)


@pytest.mark.parametrize("stop_after", [0.15, 0.6, 1.5], ids=["mid-copy", "later", "copied"])
def test_what_wait_said_is_what_the_stalled_daemon_does(stallable: DaemonProc, stop_after: float) -> None:
    d = stallable
    path = d.root / "run" / "step1" / "m.pt"
    c, t, copied, _ = stalled_save(d, path, stop_after)  # t lives on, as the trainer's tensor does
    d.proc.send_signal(signal.SIGCONT)
    status = settled(d)
    c.close(timeout=5)
    del t
    job = next(j for j in status["snapshots"] if j["path"] == str(path))
    if copied:  # the daemon had the bytes before the trainer changed them: it writes and commits them
        assert job["state"] == "durable", job
        for _ in range(100):
            if datastates.latest(d.root / "run") == "step1":
                break
            time.sleep(0.1)
        assert torch.equal(datastates.load(path)["t"], torch.full((ELEMENTS,), 1.0))
    else:  # the trainer gave up and stepped: nothing of this snapshot may ever appear
        assert job["state"] == "failed" and "abandoned" in job["error"], job
        assert not path.exists() and datastates.latest(d.root / "run") is None
    assert not list(d.root.rglob(f"*{TEMP_SUFFIX}"))


def test_mid_copy_the_trainer_is_told_unavailable_and_nothing_is_committed(stallable: DaemonProc) -> None:
    """A stall mid-copy: SIGSTOP 0.15 s into a copy of 512 MiB through 8 MiB; liveness passes; step 2; SIGCONT."""
    d = stallable
    path = d.root / "run" / "step1" / "m.pt"
    c, _, copied, _ = stalled_save(d, path, 0.15)
    assert not copied, "the copy finished within 0.15 s: this machine is too fast for the case"
    d.proc.send_signal(signal.SIGCONT)
    settled(d)
    c.close(timeout=5)
    assert datastates.latest(d.root / "run") is None and not path.exists()


def test_with_the_local_fallback_the_resumed_daemon_never_replaces_the_trainers_file(stallable: DaemonProc) -> None:
    d = stallable
    path = d.root / "run" / "step1" / "m.pt"
    c, t, copied, committed = stalled_save(d, path, 0.15, fallback="local")
    assert copied and c.local  # wait() gave up on the daemon and saved step 1 itself, before the step
    try:  # the COMMIT the daemon never answered is answered by the local commit of what wait() saved again
        committed.result(timeout=60)
    except DatastatesError as exc:
        pytest.fail(f"the local commit failed: {exc}")
    d.proc.send_signal(signal.SIGCONT)
    settled(d)
    assert datastates.latest(d.root / "run") == "step1"
    assert torch.equal(datastates.load(path)["t"], torch.full((ELEMENTS,), 1.0))  # step 1 whole, no element of step 2
    assert t[0].item() == 2.0


def test_a_daemon_stalled_before_its_rename_never_writes_over_a_trainer_that_went_local(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The daemon has copied step 1 and is still writing it when it stalls; the trainer's COMMIT goes unanswered,
    so it goes local and saves and commits step 2 under the same tag itself. Resumed, the daemon must not rename
    its step-1 file over the trainer's step 2, nor write its marker: two writers of one path (invariant I2)."""
    d = start_daemon(host_memory="1536MiB", chunk_size="64MiB")  # the copy outruns the writes: a long "flushing"
    path = d.root / "run" / "last" / "m.pt"
    c = Client(d.endpoint, timeout=30, liveness=LIVENESS, fallback="local")
    t = torch.full((ELEMENTS * 2,), 1.0)  # 1 GiB
    try:
        c.snapshot({"t": t}, path, tag="last")
        first = c.commit("last")
        for _ in range(2000):  # a hang guard: stop the daemon between its copy and its rename
            # answered late on a busy machine (CI beside two CPU hogs once took over 5 s): no failure of what this checks
            job = next((j for j in daemon_status(d.endpoint, timeout=30)["snapshots"] if j["path"] == str(path)), None)
            if job is not None and job["state"] != "copying":
                break
            time.sleep(0.005)
        d.proc.send_signal(signal.SIGSTOP)
        if job is None or job["state"] != "flushing":
            pytest.skip(f"the daemon was not caught between its copy and its rename: {job}")
        c.wait()  # the daemon claimed step 1 copied before it stalled: wait() returns, the trainer steps
        t.fill_(2.0)
        with pytest.raises(DaemonUnavailable):
            first.result(timeout=60)
        c.snapshot({"t": t}, path, tag="last")  # the daemon is gone: saved by the trainer itself
        c.wait()
        c.commit("last").result(timeout=60)
        assert c.local
    finally:
        d.proc.send_signal(signal.SIGCONT)
    status = settled(d)
    c.close(timeout=5)
    assert datastates.latest(d.root / "run") == "last"
    verify(path)  # its marker names the file that is there
    assert torch.equal(datastates.load(path)["t"], torch.full((ELEMENTS * 2,), 2.0))  # the trainer's step 2, whole
    job = next(j for j in status["snapshots"] if j["path"] == str(path))
    assert job["state"] == "failed" and "fallback='local'" in job["error"], job
    assert not list(d.root.rglob(f"*{TEMP_SUFFIX}"))


def test_after_a_stall_the_client_connects_again_as_a_new_client(stallable: DaemonProc) -> None:
    """``wait()`` said once that step 1 was lost (DaemonUnavailable); once the daemon is back, the
    next snapshot connects again as a new client (the old one released, step 1 never written), and commits."""
    d = stallable
    c, t, copied, committed = stalled_save(d, d.root / "run" / "step1" / "m.pt", 0.15)
    assert not copied, "the copy finished within 0.15 s: this machine is too fast for the case"
    with pytest.raises(DaemonUnavailable):
        committed.result(timeout=60)
    lost = c.client_id
    d.proc.send_signal(signal.SIGCONT)
    try:
        c.snapshot({"t": t}, d.root / "run" / "step2" / "m.pt")  # connects again
        c.wait()
        c.commit("step2").result(timeout=60)
        assert c.client_id != lost and not c.local
        settled(d)
        for _ in range(1200):  # a hang guard: the daemon's watch releases the client that left
            clients = [client["id"] for client in daemon_status(d.endpoint)["clients"]]
            if lost not in clients:
                break
            time.sleep(0.05)
        assert clients == [c.client_id], clients
    finally:
        c.close(timeout=5)
    assert datastates.latest(d.root / "run") == "step2" and not (d.root / "run" / "step1" / "m.pt").exists()
    assert torch.equal(datastates.load(d.root / "run" / "step2" / "m.pt")["t"], torch.full((ELEMENTS,), 2.0))


def test_a_loss_no_wait_met_is_told_by_the_next_call_which_then_connects_again(stallable: DaemonProc) -> None:
    """The daemon is stopped before it takes a snapshot in; only the commit future meets the silence (no wait()).
    The next snapshot() says the lost snapshot was abandoned (once: a later wait() has nothing to say), and once the
    daemon is back the call after it connects again as a new client and commits.

    The daemon stays stopped until the client has given up: resumed earlier, it may take the queued snapshot in and
    claim it copied first (CI, 2026-12-05), and then there is nothing abandoned to tell of."""
    d = stallable
    c = Client(d.endpoint, timeout=30, liveness=LIVENESS)
    try:
        d.proc.send_signal(signal.SIGSTOP)
        c.snapshot({"t": torch.full((1 << 20,), 1.0)}, d.root / "run" / "step1" / "m.pt")
        with pytest.raises(DaemonUnavailable, match="no sign of life"):
            c.commit("step1").result(timeout=60)
        lost, t = c.client_id, torch.full((1 << 20,), 2.0)
        with pytest.raises(DaemonUnavailable, match=r"1 snapshot\(s\) not yet copied are abandoned"):
            c.snapshot({"t": t}, d.root / "run" / "step2" / "m.pt")
        c.wait()  # told already
        d.proc.send_signal(signal.SIGCONT)
        c.snapshot({"t": t}, d.root / "run" / "step2" / "m.pt")
        c.wait()
        c.commit("step2").result(timeout=60)
        assert c.client_id != lost
    finally:
        d.proc.send_signal(signal.SIGCONT)
        c.close(timeout=5)
    settled(d)
    assert datastates.latest(d.root / "run") == "step2" and not (d.root / "run" / "step1" / "m.pt").exists()
    assert torch.equal(datastates.load(d.root / "run" / "step2" / "m.pt")["t"], t)


@pytest.mark.parametrize("folder", ["/dev/shm/datastates-{uid}-client-1-0badc0de", "/tmp", "/dev/shm/../etc"],
                         ids=["missing", "not-a-decision-folder", "escape"])
def test_a_bad_decision_folder_is_refused_at_hello_and_the_daemon_serves_on(stallable: DaemonProc, folder: str) -> None:
    conn = Connection(stallable.endpoint)
    try:
        with pytest.raises(InvalidRequestError, match="decision folder"):
            conn.call(m.Hello(pid=1, name="x", decisions=folder.format(uid=os.geteuid())), 10)
    finally:
        conn.close()
    with Client(stallable.endpoint, timeout=30) as c:  # a well-behaved client still commits
        c.snapshot({"t": torch.ones(10)}, stallable.root / "ok" / "step1" / "m.pt")
        c.commit("step1").result(timeout=60)


def test_a_commit_in_flight_when_the_trainer_goes_local_is_never_answered_with_a_later_step(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """The fault schedules, seed 92861: step 1 of tag t2 is durable and its COMMIT is in flight when the daemon
    stalls; the trainer saves step 2 under t2, goes local and commits it itself. Step 1's COMMIT used to be answered
    with that local commit (so the trainer heard "step 1 committed"), and the resumed daemon then wrote step 1's
    marker over step 2's file. Now step 1's commit fails, step 2's is the trainer's, and the daemon writes nothing."""
    d = start_daemon()
    path = d.root / "run" / "t2" / "m.pt"
    c = Client(d.endpoint, timeout=30, liveness=LIVENESS, fallback="local")
    t = torch.full((1 << 20,), 1.0)
    try:
        c.snapshot({"t": t}, path, tag="t2")
        c.wait()
        for _ in range(2000):  # a hang guard: step 1's file durable, so its commit needs only its marker
            job = next((j for j in daemon_status(d.endpoint, timeout=30)["snapshots"] if j["path"] == str(path)), None)
            if job is not None and job["state"] == "durable":
                break
            time.sleep(0.005)
        d.proc.send_signal(signal.SIGSTOP)
        first = c.commit("t2")  # in flight at a stalled daemon
        t.fill_(2.0)
        c.snapshot({"t": t}, path, tag="t2")
        second = c.commit("t2")
        c.wait()  # the daemon stays silent: step 2 is saved here
        assert c.local
        with pytest.raises(CommitError, match="lost while committing"):
            first.result(timeout=60)
        second.result(timeout=60)
    finally:
        d.proc.send_signal(signal.SIGCONT)
    settled(d)
    c.close(timeout=5)
    assert datastates.latest(d.root / "run") == "t2"
    verify(path)  # its marker names the file that is there
    assert torch.equal(datastates.load(path)["t"], torch.full((1 << 20,), 2.0))


def test_a_client_welcomed_after_it_stopped_waiting_is_let_go(start_daemon: Callable[..., DaemonProc]) -> None:
    """The fault schedules, seed 200189: a client (re)connecting to a daemon that had just resumed was welcomed,
    and the daemon stalled again before its WELCOME left. The client's HELLO failed after ``liveness`` and it
    removed its decision folder; the daemon, watching its live pid, held that client until the trainer exited,
    and never settled. Here the daemon stalls at that very point (its log output blocks on the line that says
    it welcomed the client; SIGSTOP lands there only by chance). Now a client whose folder is gone has left."""
    out, log_end = os.pipe()
    said: list[bytes] = []

    def read_to_the_end() -> None:
        said.extend(iter(lambda: os.read(out, 1 << 16), b""))
        os.close(out)

    drain = threading.Thread(target=read_to_the_end, daemon=True)
    # the test's own open file of the pipe, non-blocking to fill it; the daemon's writes still block
    filler = os.open(f"/proc/self/fd/{log_end}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        try:
            d = start_daemon(output=log_end, log_level="info")
        finally:
            os.close(log_end)  # the daemon holds its own
        os.set_blocking(out, False)
        try:  # what it said at start
            while os.read(out, 1 << 16):
                pass
        except BlockingIOError:
            pass
        os.set_blocking(out, True)
        try:  # the pipe full: the daemon's next log line blocks it
            while os.write(filler, b"." * 4096) == 4096:
                pass
            while os.write(filler, b"."):
                pass
        except BlockingIOError:
            pass
        folders = set(os.listdir(SHM_DIR))
        with pytest.raises(DaemonUnavailable, match="no sign of life"):
            Client(d.endpoint, timeout=30, liveness=LIVENESS)
        assert not {f for f in set(os.listdir(SHM_DIR)) - folders if f"-client-{os.getpid()}-" in f}
        drain.start()  # the daemon goes on: it welcomes a client that left
        for _ in range(1200):  # a hang guard: the line comes once the drain made room for it
            found = re.search(rb"client (c\d+-\d+) connected", b"".join(said))
            if found:
                break
            time.sleep(0.05)
        assert found, b"".join(said)[-2000:].decode(errors="replace")
        welcomed = found.group(1).decode()
        for _ in range(1200):  # a hang guard: the daemon's watch looks every client_timeout / 6
            status = daemon_status(d.endpoint)
            if not status["clients"]:
                break
            time.sleep(0.05)
        assert not status["clients"], f"the daemon still holds {[c['id'] for c in status['clients']]}"
        assert [c["how"] for c in status["clients_lost"] if c["id"] == welcomed] == ["left"]
    finally:
        os.close(filler)
        if drain.ident is None:  # not started
            os.set_blocking(out, True)
            drain.start()  # the daemon's last lines at teardown must not block it
