"""Real daemons for the tests: each fixture starts a `datastatesd` process on its own endpoint."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import yaml

from datastates.client.connection import Connection
from datastates.protocol import messages as m
from datastates.protocol.errors import DaemonUnavailable

BIN = Path(sys.executable).parent
DATASTATESD = str(BIN / "datastatesd")
DATASTATESCTL = str(BIN / "datastatesctl")


@dataclass
class DaemonProc:
    """A running datastatesd: its endpoint, the root it may write, its config and log."""

    endpoint: str
    root: Path
    config: Path
    log: Path
    proc: subprocess.Popen
    env: dict[str, str] = field(default_factory=dict)

    def ctl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [DATASTATESCTL, "--endpoint", self.endpoint, *args], capture_output=True, text=True, timeout=timeout
        )

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def wait_ready(endpoint: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    conn = Connection(endpoint)
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"datastatesd exited with {proc.returncode}:\n{log.read_text()}")
            try:
                conn.call(m.Status(), 0.5)
                return
            except DaemonUnavailable:
                continue
        raise RuntimeError(f"datastatesd not ready after {timeout} s:\n{log.read_text()}")
    finally:
        conn.close()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    """Factory: start_daemon(**node_yaml_overrides) -> DaemonProc, stopped at teardown."""
    started: list[DaemonProc] = []
    sockdir = tempfile.mkdtemp(prefix="ds-")  # short: unix socket paths are limited to ~107 bytes

    def start(**overrides: Any) -> DaemonProc:
        n = len(started)
        root = tmp_path / "ckpt"
        root.mkdir(exist_ok=True)
        cfg = {
            "endpoint": f"ipc://{sockdir}/d{n}/datastatesd.sock",
            "storage": {"roots": [str(root)]},
            "host_memory": "64MiB",
            "chunk_size": "4MiB",
            "log_level": "debug",
        }
        cfg.update(overrides)
        config = tmp_path / f"node{n}.yaml"
        config.write_text(yaml.safe_dump(cfg))
        log = tmp_path / f"datastatesd{n}.log"
        proc = subprocess.Popen([DATASTATESD, "--node-config", str(config)], stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_ready(cfg["endpoint"], proc, log)
        d = DaemonProc(endpoint=cfg["endpoint"], root=root, config=config, log=log, proc=proc)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProc]) -> DaemonProc:
    """One datastatesd with the test defaults."""
    return start_daemon()


@pytest.fixture
def client(daemon: DaemonProc) -> Iterator[Any]:
    from datastates.client import Client

    c = Client(daemon.endpoint, timeout=60)
    yield c
    c.close()
