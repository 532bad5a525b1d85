"""`datastatesctl verify`: a whole tag checked file by file, sizes and checksums, with no daemon."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from datastates.client import Client

from conftest import DATASTATESCTL, DaemonProc, file_index, save


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder


def ctl_verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DATASTATESCTL, "verify", *args], capture_output=True, text=True, timeout=120)


def committed_tag(daemon: DaemonProc) -> Path:
    folder = daemon.root / "global_step4"
    with Client(daemon.endpoint, timeout=60) as c:
        c.snapshot({"w": torch.randn(64, 1024), "step": 4}, folder / "model_states.pt")
        save(c, {"exp_avg": torch.randn(128, 1024)}, folder / "optim_states.pt", tag="global_step4")
    return folder


def test_verify_a_sound_tag_by_folder_by_name_and_by_file(daemon: DaemonProc) -> None:
    folder = committed_tag(daemon)
    by_folder = ctl_verify(str(folder))
    assert by_folder.returncode == 0, by_folder.stdout + by_folder.stderr
    assert by_folder.stdout.count("ok ") == 2
    by_name = ctl_verify("--root", str(daemon.root), "global_step4")
    assert by_name.returncode == 0 and by_name.stdout.count("ok ") == 2
    one = ctl_verify(str(folder / "optim_states.pt"))
    assert one.returncode == 0 and "optim_states.pt" in one.stdout


def test_verify_names_the_corrupt_file_and_tensor(daemon: DaemonProc) -> None:
    folder = committed_tag(daemon)
    path = folder / "optim_states.pt"
    raw = bytearray(path.read_bytes())
    header, _, _, base = file_index(bytes(raw))
    last = header.storages[-1]
    raw[base + last.offset + last.nbytes - 100] ^= 0xFF  # inside the last storage's bytes
    path.write_bytes(bytes(raw))
    out = ctl_verify(str(folder))
    assert out.returncode == 1
    (bad,) = [ln for ln in out.stdout.splitlines() if ln.startswith("CORRUPT")]
    assert "optim_states.pt" in bad and "exp_avg" in bad
    assert any(ln.startswith("ok") and "model_states.pt" in ln for ln in out.stdout.splitlines())


def test_verify_reports_a_missing_file_and_an_unknown_tag(daemon: DaemonProc) -> None:
    folder = committed_tag(daemon)
    (folder / "model_states.pt").unlink()
    out = ctl_verify(str(folder))
    assert out.returncode == 1 and "model_states.pt" in out.stdout
    unknown = ctl_verify("--root", str(daemon.root), "global_step99")
    assert unknown.returncode == 2 and "no commit marker" in unknown.stderr


def test_the_safe_default_loads_training_objects_and_refuses_arbitrary_ones(daemon: DaemonProc) -> None:
    """Safe by default (weights_only=True, as torch.load): tensors, containers and the objects training states
    commonly hold load; any other object is refused unless the caller opts in with weights_only=False."""
    import argparse
    import collections
    import fractions
    import random

    import numpy as np
    import pytest

    import datastates
    from datastates.protocol.errors import WeightsOnlyError

    from conftest import assert_state_equal

    plain = {"model": collections.OrderedDict(w=torch.randn(8, 8)), "step": 7, "lr": [0.1, 0.01], "name": "gpt"}
    training = {"np_rng": np.random.get_state(), "py_rng": random.getstate(), "torch_rng": torch.get_rng_state(),
                "schedule": np.linspace(0, 1, 5), "dtype": np.dtype("float16"), "scale": np.float32(2.0),
                "shape": torch.Size([2, 3]), "args": argparse.Namespace(lr=0.1, layers=2), "half": torch.float16}
    risky = {"w": torch.randn(3), "ratio": fractions.Fraction(1, 3)}  # any class: its reduce can run code
    with Client(daemon.endpoint, timeout=60) as c:
        save(c, plain, daemon.root / "t_plain" / "model_states.pt")
        save(c, training, daemon.root / "t_training" / "model_states.pt")
        save(c, risky, daemon.root / "t_risky" / "model_states.pt")
    assert_state_equal(plain, datastates.load(daemon.root / "t_plain" / "model_states.pt"))
    loaded = datastates.load(daemon.root / "t_training" / "model_states.pt")
    assert loaded["np_rng"][0] == "MT19937" and np.array_equal(loaded["np_rng"][1], training["np_rng"][1])
    assert loaded["py_rng"] == training["py_rng"] and torch.equal(loaded["torch_rng"], training["torch_rng"])
    assert np.array_equal(loaded["schedule"], training["schedule"]) and loaded["dtype"] == np.float16
    assert loaded["scale"] == np.float32(2.0) and loaded["shape"] == torch.Size([2, 3])
    assert loaded["args"] == training["args"] and loaded["half"] is torch.float16
    with pytest.raises(WeightsOnlyError, match="safe loader"):
        datastates.load(daemon.root / "t_risky" / "model_states.pt")
    assert datastates.load(daemon.root / "t_risky" / "model_states.pt", weights_only=False)["ratio"] == risky["ratio"]
