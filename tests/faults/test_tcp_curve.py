"""tcp endpoints: refused unless the config asks for them with CURVE keys; then only authorized clients get in.

(a) a tcp endpoint without allow_tcp, (b) allow_tcp without keys and other bad tcp configs,
(c) an authorized client snapshots, commits and loads bitwise, (d) a client without keys
is refused before it connects, (e) an unauthorized keypair or the wrong server key cannot
talk to the daemon, which goes on serving, (f) datastatesctl over tcp.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml
import zmq
import zmq.auth

import datastates
from datastates.client import Client
from datastates.daemon import config
from datastates.protocol import messages as m
from datastates.protocol.errors import ConfigError, DaemonUnavailable
from datastates.protocol.security import CLIENT_CERT_ENV, SERVER_KEY_ENV, secure_client

from conftest import DATASTATESCTL, DaemonProc, assert_state_equal, run_datastatesd, save


@dataclass
class Keys:
    """Certificates as an operator makes them: the daemon's pair, an authorized folder, and outsiders."""

    daemon_public: Path
    daemon_secret: Path
    authorized: Path
    trainer_secret: Path
    outsider_secret: Path
    impostor_public: Path

    def curve(self) -> dict[str, str]:
        return {"server_secret_key": str(self.daemon_secret), "authorized_clients": str(self.authorized)}


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700)
    path.chmod(0o700)  # whatever the umask: the daemon refuses an authorized folder others may write
    return path


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    made = {}
    for owner in ("daemon", "trainer", "outsider", "impostor"):
        public, secret = zmq.auth.create_certificates(_private_dir(tmp_path / f"keys-{owner}"), owner)
        made[owner] = (Path(public), Path(secret))
    authorized = _private_dir(tmp_path / "authorized")
    shutil.copy(made["trainer"][0], authorized)
    return Keys(daemon_public=made["daemon"][0], daemon_secret=made["daemon"][1], authorized=authorized,
                trainer_secret=made["trainer"][1], outsider_secret=made["outsider"][1],
                impostor_public=made["impostor"][0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoint(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A free loopback port; the daemon's port lock goes to a runtime folder of this test's own."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp))
    return f"tcp://127.0.0.1:{free_port()}"


def as_client(monkeypatch: pytest.MonkeyPatch, server_key: Path, client_cert: Path) -> None:
    monkeypatch.setenv(SERVER_KEY_ENV, str(server_key))
    monkeypatch.setenv(CLIENT_CERT_ENV, str(client_cert))


@pytest.fixture
def tcp_daemon(endpoint: str, keys: Keys, monkeypatch: pytest.MonkeyPatch,
               start_daemon: Callable[..., DaemonProc]) -> DaemonProc:
    """A CURVE daemon on loopback, with this process set up as its authorized trainer."""
    as_client(monkeypatch, keys.daemon_public, keys.trainer_secret)
    return start_daemon(endpoint=endpoint, allow_tcp=True, curve=keys.curve())


def refuse_to_start(tmp_path: Path, **cfg: Any) -> subprocess.CompletedProcess:
    node = tmp_path / "node.yaml"
    node.write_text(yaml.safe_dump({"storage": {"roots": [str(tmp_path)]}, **cfg}))
    run = run_datastatesd("--node-config", str(node))
    assert run.returncode == 2, run.stderr
    return run


def assert_serves(d: DaemonProc, tag: str) -> None:
    """The authorized trainer snapshots, commits and loads back bitwise."""
    state = {"w": torch.randn(1 << 16), "b": torch.arange(1000, dtype=torch.int64), "step": 7}
    with Client(d.endpoint, timeout=60) as c:
        committed = save(c, state, d.root / tag / "model_states.pt")
    assert committed.tag == tag
    assert_state_equal(state, datastates.load(committed.files[0]))


# -- (a), (b) the config -----------------------------------------------------------------


def test_tcp_without_allow_tcp_refuses_to_start(tmp_path: Path, endpoint: str, keys: Keys) -> None:
    """Even with keys, a tcp endpoint must be asked for: the error names allow_tcp."""
    run = refuse_to_start(tmp_path, endpoint=endpoint, curve=keys.curve())
    assert "allow_tcp" in run.stderr and endpoint in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("curve", [None, {"server_secret_key": "daemon"}, {"authorized_clients": "authorized"}],
                         ids=["no-curve", "no-authorized-clients", "no-server-key"])
def test_allow_tcp_without_keys_refuses_to_start(tmp_path: Path, endpoint: str, keys: Keys,
                                                 curve: dict[str, str] | None) -> None:
    """allow_tcp alone is not enough: the error names the missing curve key."""
    paths = {"daemon": str(keys.daemon_secret), "authorized": str(keys.authorized)}
    cfg: dict[str, Any] = {"endpoint": endpoint, "allow_tcp": True}
    if curve is not None:
        cfg["curve"] = {k: paths[v] for k, v in curve.items()}
    missing = next(k for k in ("server_secret_key", "authorized_clients") if k not in (curve or {}))
    run = refuse_to_start(tmp_path, **cfg)
    assert f"curve.{missing}" in run.stderr and "Traceback" not in run.stderr


def _folder_with(tmp_path: Path, name: str, mode: int, *certs: Path) -> str:
    folder = _private_dir(tmp_path / name)
    for cert in certs:
        shutil.copy(cert, folder)
    folder.chmod(mode)
    return str(folder)


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "not-a-certificate"
    path.write_text(text)
    return str(path)


BAD_TCP_CONFIGS: dict[str, tuple[Callable[[Keys, Path], dict[str, Any]], str]] = {
    "no-port": (lambda k, t: {"endpoint": "tcp://127.0.0.1"}, "endpoint"),
    "wildcard-port": (lambda k, t: {"endpoint": "tcp://127.0.0.1:*"}, "endpoint"),
    "port-out-of-range": (lambda k, t: {"endpoint": "tcp://127.0.0.1:70000"}, "endpoint"),
    "other-transport": (lambda k, t: {"endpoint": "udp://127.0.0.1:5555"}, "endpoint"),
    "allow-tcp-not-a-bool": (lambda k, t: {"allow_tcp": "yes"}, "allow_tcp"),
    "curve-not-a-mapping": (lambda k, t: {"curve": str(k.daemon_secret)}, "curve"),
    "unknown-curve-key": (lambda k, t: {"curve": {**k.curve(), "allow_any": True}}, "allow_any"),
    "public-cert-as-server-key": (lambda k, t: {"curve": {**k.curve(), "server_secret_key": str(k.daemon_public)}},
                                  "curve.server_secret_key"),
    "missing-server-key": (lambda k, t: {"curve": {**k.curve(), "server_secret_key": str(t / "nope.key_secret")}},
                           "curve.server_secret_key"),
    "not-a-certificate": (lambda k, t: {"curve": {**k.curve(), "server_secret_key": _file(t, "endpoint: x\n")}},
                          "curve.server_secret_key"),
    "relative-path": (lambda k, t: {"curve": {**k.curve(), "authorized_clients": "authorized"}},
                      "curve.authorized_clients"),
    "missing-folder": (lambda k, t: {"curve": {**k.curve(), "authorized_clients": str(t / "nope")}},
                       "curve.authorized_clients"),
    "empty-folder": (lambda k, t: {"curve": {**k.curve(), "authorized_clients": _folder_with(t, "empty", 0o700)}},
                     "curve.authorized_clients"),
    "folder-others-may-write": (
        lambda k, t: {"curve": {**k.curve(),
                                "authorized_clients": _folder_with(t, "open", 0o777, k.authorized / "trainer.key")}},
        "curve.authorized_clients"),
}


@pytest.mark.parametrize("case", list(BAD_TCP_CONFIGS))
def test_bad_tcp_config_names_the_key(tmp_path: Path, keys: Keys, case: str) -> None:
    """Every way a tcp config can be wrong is a ConfigError naming the key to fix, before anything binds."""
    overrides, key = BAD_TCP_CONFIGS[case]
    with pytest.raises(ConfigError) as err:
        config.from_mapping({"endpoint": "tcp://127.0.0.1:5555", "allow_tcp": True, "curve": keys.curve(),
                             **overrides(keys, tmp_path)})
    assert key in err.value.message, err.value.message


def test_ipc_endpoints_need_no_keys(short_tmp: Path) -> None:
    assert config.from_mapping({"endpoint": f"ipc://{short_tmp}/d.sock"}).allow_tcp is False


# -- (c) an authorized client --------------------------------------------------------------


def test_authorized_client_snapshots_commits_and_loads(tcp_daemon: DaemonProc) -> None:
    assert_serves(tcp_daemon, "global_step1")


def test_second_daemon_on_the_same_port_refuses(tcp_daemon: DaemonProc) -> None:
    """The port lock keeps a second daemon off the endpoint, and the first one serves on."""
    run = run_datastatesd("--node-config", str(tcp_daemon.config))
    assert run.returncode == 2 and "already serving" in run.stderr and tcp_daemon.endpoint in run.stderr
    assert_serves(tcp_daemon, "global_step2")


# -- (d) no keys ----------------------------------------------------------------------------


@pytest.mark.parametrize("unset", [SERVER_KEY_ENV, CLIENT_CERT_ENV])
def test_client_without_keys_is_refused_before_connecting(tcp_daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch,
                                                         unset: str) -> None:
    monkeypatch.delenv(unset)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(ConfigError, match=r"\$" + unset):
            secure_client(sock, tcp_daemon.endpoint)
    finally:
        sock.close(0)
        ctx.term()
    with pytest.raises(ConfigError, match="tcp endpoint"):
        Client(tcp_daemon.endpoint, timeout=2)


def test_client_with_a_public_cert_as_its_own_is_refused(tcp_daemon: DaemonProc, keys: Keys,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The client needs its secret certificate; handing it the public one is a clear error, not a silent hang."""
    as_client(monkeypatch, keys.daemon_public, keys.authorized / "trainer.key")
    with pytest.raises(ConfigError, match=CLIENT_CERT_ENV + ".*key_secret"):
        Client(tcp_daemon.endpoint, timeout=2)


# -- (e) the wrong keys ---------------------------------------------------------------------


def _wait_for_log(d: DaemonProc, text: str, guard_s: float = 60) -> bool:
    deadline = time.monotonic() + guard_s  # a hang guard only: the line is logged during the handshake
    while text not in d.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in d.log_text()


def connect_refused(endpoint: str, timeout: float = 2, liveness: float = 15, guard_s: float = 30) -> BaseException | None:
    """What ``Client(endpoint)`` raised, run on a thread so that a hang fails the test in ``guard_s``, not at the suite timeout."""
    raised: list[BaseException | None] = [None]

    def connect() -> None:
        try:
            Client(endpoint, timeout=timeout, liveness=liveness).close()
        except BaseException as exc:  # handed to the test thread
            raised[0] = exc

    worker = threading.Thread(target=connect, name="refused-client", daemon=True)
    worker.start()
    worker.join(guard_s)  # a hang guard only
    if worker.is_alive():
        pytest.fail(f"Client({endpoint!r}) hung after the daemon refused its handshake: a DEALER whose only peer was "
                    "dropped blocks in send (client/connection.py Connection._send)")
    return raised[0]


def test_unauthorized_keypair_is_refused_by_the_daemon(tcp_daemon: DaemonProc, keys: Keys,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid keypair whose public key is not in the authorized folder gets no answer; the daemon logs the refusal."""
    as_client(monkeypatch, keys.daemon_public, keys.outsider_secret)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(sock, tcp_daemon.endpoint)
        sock.connect(tcp_daemon.endpoint)
        try:
            sock.send_multipart(m.encode(m.Status(), 1), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # the refusal came first: libzmq dropped the connection, and nothing can be queued
        assert not sock.poll(2000)
    finally:
        sock.close()
        ctx.term()
    outsider_key = zmq.auth.load_certificate(keys.outsider_secret)[0].decode()
    assert _wait_for_log(tcp_daemon, f"refused a tcp client: its CURVE public key {outsider_key}")
    as_client(monkeypatch, keys.daemon_public, keys.trainer_secret)
    assert_serves(tcp_daemon, "after-outsider")



def test_unauthorized_client_gets_daemon_unavailable(tcp_daemon: DaemonProc, keys: Keys,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    as_client(monkeypatch, keys.daemon_public, keys.outsider_secret)
    assert isinstance(connect_refused(tcp_daemon.endpoint), DaemonUnavailable)
    as_client(monkeypatch, keys.daemon_public, keys.trainer_secret)
    assert_serves(tcp_daemon, "after-outsider")


def test_unauthorized_client_probing_before_its_hello_times_out(tcp_daemon: DaemonProc, keys: Keys,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With the defaults (timeout 30 s > liveness / 2) the client probes a refused daemon before HELLO times out."""
    as_client(monkeypatch, keys.daemon_public, keys.outsider_secret)
    assert isinstance(connect_refused(tcp_daemon.endpoint, timeout=3, liveness=2, guard_s=20), DaemonUnavailable)


def test_wrong_server_key_cannot_talk_to_the_daemon(tcp_daemon: DaemonProc, keys: Keys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An authorized client that trusts another server key never completes the handshake."""
    as_client(monkeypatch, keys.impostor_public, keys.trainer_secret)
    assert isinstance(connect_refused(tcp_daemon.endpoint), DaemonUnavailable)
    as_client(monkeypatch, keys.daemon_public, keys.trainer_secret)
    assert_serves(tcp_daemon, "after-impostor")


def test_plain_zeromq_peer_gets_no_answer(tcp_daemon: DaemonProc) -> None:
    """A DEALER without CURVE (a port scanner, a misconfigured tool) never reaches the daemon's handlers."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(tcp_daemon.endpoint)
        sock.send_multipart([b"\x80", b"\x80"])
        assert not sock.poll(2000)
    finally:
        sock.close()
        ctx.term()
    assert_serves(tcp_daemon, "after-plain")


# -- (f) datastatesctl -----------------------------------------------------------------------


def test_ctl_status_over_tcp(tcp_daemon: DaemonProc) -> None:
    assert_serves(tcp_daemon, "global_step3")
    run = tcp_daemon.ctl("status", "--json")
    assert run.returncode == 0, run.stderr
    status = json.loads(run.stdout)
    assert status["daemon"]["endpoint"] == tcp_daemon.endpoint
    assert "global_step3" in [c["tag"] for c in status["committed"]]
    assert tcp_daemon.ctl("status").returncode == 0


def test_ctl_without_keys_says_which_variable(tcp_daemon: DaemonProc) -> None:
    env = {k: v for k, v in os.environ.items() if k not in (SERVER_KEY_ENV, CLIENT_CERT_ENV)}
    run = subprocess.run([DATASTATESCTL, "--endpoint", tcp_daemon.endpoint, "status"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 2
    assert SERVER_KEY_ENV in run.stderr and CLIENT_CERT_ENV in run.stderr and "Traceback" not in run.stderr
