"""Connections and descriptors: no client can make the daemon run out of them.

ZeroMQ aborts the whole daemon when an accept meets the open-files limit, and keeps a peer
that connected and never speaks forever. These start real daemons under a given
``ulimit -n`` and attack them with real sockets:

- 2,000 DEALER sockets that connect at once and never send anything, at the usual
  ``ulimit -n 1024`` (soft; the hard limit above it): the daemon raises its soft limit to the
  hard one, keeps at most a bounded number of silent connections, shuts the rest, keeps
  serving real trainers, and its status says so; a tool that asks for the status again and again,
  each time on a new connection, gets every answer. A daemon run as root raises even a hard
  limit of 1024 and outlives the same burst. (A user's daemon under a hard limit of 1024
  cannot: the burst outruns the shedding and ZeroMQ aborts it, so it warns at start.)
- a connection every 10 ms that sends one byte (a raw socket: half a greeting; a ZeroMQ peer: a
  one-byte message) and never says HELLO, under a hard limit of 256 the daemon may not raise:
  it keeps at most a quarter of its limit unintroduced, sheds the rest, and serves a trainer;
- as many connections as the daemon keeps unintroduced, each asking something other than HELLO
  every second: a trainer that connects meanwhile is served;
- eight trainers of 600 storages each checkpoint at a hard ``ulimit -n 1024`` (storages
  read in place cost the daemon no descriptor);
- beyond ``max_clients`` a new client gets a clear refusal, and the others are served.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

import datastates
from datastates.client import Client, daemon_status
from datastates.protocol.errors import DaemonUnavailable, TooManyClientsError

from conftest import DaemonProc, RawPeer, assert_state_equal, save

SILENT_PEERS = r"""
import sys, time, zmq
ctx = zmq.Context()
ctx.max_sockets = 4096
socks = []
for _ in range(int(sys.argv[2])):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
    socks.append(s)
print("CONNECTED", flush=True)
time.sleep(600)
"""


STATUS_POLLS = 100
"""Status requests amid the flood, each on a new connection: about 3 in 100 lost their reply while an answered
connection was shed as soon as it was the oldest."""


def _flood_and_train(d: DaemonProc) -> None:
    """2,000 silent peers connect at once; the daemon lives, sheds them, and serves real trainers meanwhile."""
    from datastates.daemon.connections import MAX_UNINTRODUCED

    peers = subprocess.Popen([sys.executable, "-c", SILENT_PEERS, d.endpoint, "2000"], stdout=subprocess.PIPE, text=True)
    try:
        assert peers.stdout is not None and peers.stdout.readline().strip() == "CONNECTED"
        time.sleep(3)  # let ZeroMQ accept (and reconnect) as fast as it can
        assert d.proc.poll() is None, "the daemon died (ZeroMQ aborts on EMFILE)"
        st = daemon_status(d.endpoint, timeout=30)
        assert st["connections"]["unintroduced"] <= MAX_UNINTRODUCED
        assert st["connections"]["shut_down"] > 0
        # the peers reconnect as soon as they are shut (ZeroMQ's reconnect_ivl), so the daemon churns through
        # them; what it holds stays far from its limit, and fewer than the peers
        assert st["daemon"]["descriptors"]["open"] < 3072
        # real trainers are served meanwhile: each connects while the flood churns, and a stale accept event
        # for a descriptor number its connection now holds must not take it for a silent one
        for i in range(6):
            with Client(d.endpoint, timeout=60) as c:
                state = {"w": torch.randn(1000)}
                for step in range(3):
                    save(c, state, d.root / f"amid-silence-{i}" / f"m{step}.pt")
            assert_state_equal(state, datastates.load(d.root / f"amid-silence-{i}" / "m2.pt"))
        # a status tool's connection is not introduced, and the count bound sheds the oldest: each answer must still
        # leave before its connection is shut (ZeroMQ writes it later, behind the flood)
        unanswered = 0
        for _ in range(STATUS_POLLS):
            try:
                daemon_status(d.endpoint, timeout=20)
            except DaemonUnavailable:
                unanswered += 1
        assert unanswered == 0, f"{unanswered} of {STATUS_POLLS} status requests amid the flood got no answer in 20 s"
    finally:
        peers.kill()
        peers.wait()
    assert d.proc.poll() is None


def _may_raise_hard_limits() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (so the daemons it starts may too)."""
    from conftest import CAP_SYS_RESOURCE

    caps = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> CAP_SYS_RESOURCE & 1)


@pytest.mark.heavy
def test_two_thousand_silent_connections_cost_bounded_descriptors(start_daemon: Callable[..., DaemonProc]) -> None:
    """A user's daemon (no privilege) at ``ulimit -Sn 1024`` under a hard limit of 4096."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard open-files limit here is {hard}: 2,000 connections need more")
    d = start_daemon(nofile=(1024, 4096), unprivileged=True)
    st = daemon_status(d.endpoint)["daemon"]["descriptors"]
    assert st["soft_limit"] == st["hard_limit"] == 4096, "the daemon did not raise its soft limit to the hard one"
    _flood_and_train(d)


@pytest.mark.heavy
def test_a_privileged_daemon_lifts_a_hard_limit_of_1024_and_outlives_the_flood(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """Run as root (as deploy/datastatesd.service does), the daemon raises even the hard limit, so a burst of
    2,000 connections, which would abort it at 1024 (ZeroMQ's ipc accept asserts on EMFILE), costs nothing."""
    from datastates.daemon.main import ENOUGH_DESCRIPTORS

    if not _may_raise_hard_limits():
        pytest.skip("these tests lack CAP_SYS_RESOURCE (not root, or a container that drops it): no process they "
                    "start may raise its hard open-files limit")
    d = start_daemon(nofile=(1024, 1024))
    st = daemon_status(d.endpoint)["daemon"]["descriptors"]
    assert st["soft_limit"] == st["hard_limit"] == ENOUGH_DESCRIPTORS
    _flood_and_train(d)


def test_an_unprivileged_daemon_under_a_hard_limit_of_1024_warns_at_start(
        start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(nofile=(512, 1024), unprivileged=True)
    st = daemon_status(d.endpoint)["daemon"]["descriptors"]
    assert st["soft_limit"] == st["hard_limit"] == 1024
    assert "the open-files hard limit is 1024: that many connections at once would abort the daemon" in d.log.read_text()


ONE_BYTE_PEERS = r"""
import resource, socket, sys, time, zmq
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
endpoint, n = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
ctx.max_sockets = 4 * n
kept = []
start = time.monotonic()
for i in range(n):
    if i % 2:  # a raw socket that sends one byte: never a whole ZeroMQ greeting
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)  # a daemon that stopped accepting must not hang the flood
        try:
            s.connect(endpoint.removeprefix("ipc://"))
            s.send(b"\xff")
        except OSError:  # shut by the daemon already, or not accepted
            pass
    else:  # a ZeroMQ peer that sends a one-byte message and never HELLO; shut, it stays away
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, -1)
        s.connect(endpoint)
        try:
            s.send(b"x", zmq.NOBLOCK)
        except zmq.Again:  # shut before its greeting: no peer to send to
            pass
    kept.append(s)
    time.sleep(max(0.0, start + (i + 1) / 100 - time.monotonic()))  # about 100 a second
print("SENT", flush=True)
time.sleep(600)
"""


@pytest.mark.heavy
def test_connections_that_send_one_byte_and_never_say_hello_are_shed_under_a_hard_limit_of_256(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """1,500 connections at about 100 a second, each sending one byte and never HELLO, against a daemon whose
    hard limit of 256 it may not raise: ZeroMQ aborted it ("Too many open files") within seconds. It lives,
    keeps at most a quarter of its limit unintroduced, serves a trainer throughout, and says it shed."""
    d = start_daemon(nofile=(256, 256), unprivileged=True)
    peers = subprocess.Popen([sys.executable, "-c", ONE_BYTE_PEERS, d.endpoint, "1500"], stdout=subprocess.PIPE,
                             text=True)
    try:
        with Client(d.endpoint, timeout=60) as c:
            for step in range(5):  # amid the flood
                state = {"w": torch.full((1000,), float(step))}
                save(c, state, d.root / "amid-one-byte" / f"m{step}.pt")
                assert_state_equal(state, datastates.load(d.root / "amid-one-byte" / f"m{step}.pt"))
            assert peers.stdout is not None and peers.stdout.readline().strip() == "SENT"
            assert d.proc.poll() is None, "the daemon died (ZeroMQ aborts on EMFILE)"
            st = daemon_status(d.endpoint, timeout=30)
            shed = st["connections"]
            assert shed["max_unintroduced"] == 256 // 4 and shed["unintroduced"] <= shed["max_unintroduced"], shed
            assert shed["shut_down"] > 1000, shed
            assert st["daemon"]["descriptors"]["open"] < shed["shed_at_descriptors"], st["daemon"]["descriptors"]
        with Client(d.endpoint, timeout=60) as c:  # a trainer that comes while the flood's peers are still there
            state = {"w": torch.arange(1000.0)}
            save(c, state, d.root / "after-one-byte" / "m.pt")
            assert_state_equal(state, datastates.load(d.root / "after-one-byte" / "m.pt"))
    finally:
        peers.kill()
        peers.wait()
    assert d.proc.poll() is None
    assert "shut down a connection that never said HELLO" in d.log_text()


CHATTY_PEERS = r"""
import sys, time, zmq
ctx = zmq.Context()
socks = [ctx.socket(zmq.DEALER) for _ in range(int(sys.argv[2]))]
for s in socks:
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sys.argv[1])
rounds = 0
while True:  # each peer sends a one-byte request a second, and reads whatever came back
    start = time.monotonic()
    for s in socks:
        try:
            s.send(b"x", zmq.NOBLOCK)
        except zmq.Again:
            pass
        while s.poll(0):
            s.recv()
    rounds += 1
    if rounds == 3:
        print("ASKING", flush=True)
    time.sleep(max(0.0, start + 1 - time.monotonic()))
"""


@pytest.mark.heavy
def test_connections_that_keep_asking_without_hello_do_not_push_a_new_trainer_out(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """As many connections as the daemon keeps unintroduced, each sending a request that is not HELLO every
    second: each answer ranks its connection last among those to shed while its reply leaves, but only the newest
    few are ranked so, so a trainer that connects meanwhile still has the queue's time to say HELLO."""
    from datastates.daemon.connections import MAX_UNINTRODUCED

    d = start_daemon()
    assert daemon_status(d.endpoint)["connections"]["max_unintroduced"] == MAX_UNINTRODUCED
    peers = subprocess.Popen([sys.executable, "-c", CHATTY_PEERS, d.endpoint, str(MAX_UNINTRODUCED)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert peers.stdout is not None and peers.stdout.readline().strip() == "ASKING"
        for i in range(5):
            with Client(d.endpoint, timeout=30) as c:
                state = {"w": torch.full((100,), float(i))}
                save(c, state, d.root / "amid-asking" / f"m{i}.pt")
            assert_state_equal(state, datastates.load(d.root / "amid-asking" / f"m{i}.pt"))
    finally:
        peers.kill()
        peers.wait()
    assert d.proc.poll() is None


TRAINER = r"""
import sys, torch
from datastates.client import Client
endpoint, root, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
g = torch.Generator().manual_seed(rank)
state = {f"p{i}": torch.randn(64, generator=g) for i in range(600)}
with Client(endpoint, timeout=120) as c:
    c.snapshot(state, f"{root}/step1/rank{rank}.pt", tag="step1")
    c.wait()
    c.commit("step1").result(timeout=120)
print("OK", flush=True)
"""


@pytest.mark.heavy
def test_eight_trainers_of_600_storages_each_at_ulimit_1024(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(nofile=(1024, 1024))
    procs = [subprocess.Popen([sys.executable, "-c", TRAINER, d.endpoint, str(d.root / f"r{r}"), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(8)]
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and "OK" in out, f"rank {rank}: {err[-2000:]}"
    for rank in range(8):
        g = torch.Generator().manual_seed(rank)
        assert_state_equal({f"p{i}": torch.randn(64, generator=g) for i in range(600)},
                           datastates.load(d.root / f"r{rank}" / "step1" / f"rank{rank}.pt"))
    assert d.proc.poll() is None


def test_a_client_beyond_max_clients_is_refused_and_the_others_served(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon(max_clients=2)
    with Client(d.endpoint, timeout=30) as a, Client(d.endpoint, timeout=30):
        with pytest.raises(TooManyClientsError, match="max_clients"):
            Client(d.endpoint, timeout=30)
        save(a, {"x": torch.arange(3)}, d.root / "served" / "m.pt")
    with Client(d.endpoint, timeout=30) as c:  # room again once they left
        save(c, {"x": torch.arange(4)}, d.root / "again" / "m.pt")
    assert_state_equal({"x": torch.arange(4)}, datastates.load(d.root / "again" / "m.pt"))


@pytest.mark.heavy
def test_a_tool_that_polls_status_without_hello_is_never_shut_for_its_age(daemon: DaemonProc) -> None:
    """``datastatesctl status --watch`` and ``wait`` poll without HELLO, one request every few seconds. Shut for
    its age between two polls, a request on its way would be lost (the tool then times out): a connection whose
    request was served stays, bounded only by the number kept; one that never got an answer still goes."""
    from datastates.daemon.connections import SWEEP_S, UNINTRODUCED_S

    poller = RawPeer(daemon.endpoint)
    try:
        _, first = poller.request("status", {})
        assert first["status"]["connections"]["shut_down"] == 0, first["status"]["connections"]
        time.sleep(UNINTRODUCED_S + 4 * SWEEP_S)  # a watch with a long interval, idle past the age limit
        _, later = poller.request("status", {})
        assert later["status"]["connections"]["shut_down"] == 0, later["status"]["connections"]
    finally:
        poller.close()


def test_a_stale_accept_event_for_a_number_a_folder_took_keeps_no_descriptor_and_no_lock_of_it(tmp_path: Path) -> None:
    """The monitor's accept events come late, and a number ZeroMQ closed may be a folder's by then: the one a commit
    locks (``folder_locked``) for its check and rename. Looking at it must leave nothing of that folder open: a
    leaked duplicate kept the commit's flock, and the folder's next commit waited forever (a tag never committed on
    its next tier; eight trainers' commits hung)."""
    import fcntl
    import os

    import zmq.asyncio

    from datastates.daemon.connections import Connections, open_descriptors
    from datastates.protocol.storage.posix import folder_locked

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(f"ipc://{tmp_path}/d.sock")
        conns = Connections(sock)
        folder = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        before = open_descriptors()
        conns._event({"event": zmq.EVENT_ACCEPTED, "value": folder, "endpoint": b""})  # stale: the number is the folder's
        assert open_descriptors() == before
        assert conns.status()["unintroduced"] == 0  # not taken for a connection either
        with folder_locked(folder):  # a commit's check and marker rename in that folder
            pass
        os.close(folder)
        again = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)  # the folder's next commit
        try:
            fcntl.flock(again, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while a leaked duplicate holds it
        finally:
            os.close(again)
    finally:
        ctx.destroy(linger=0)  # the monitor's socket too

