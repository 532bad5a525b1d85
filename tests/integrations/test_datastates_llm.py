"""DataStates-LLM's API (``datastates.CheckpointEngine``, ``datastates.llm.Checkpointing``) against a real daemon.

DeepSpeed's ``datastates_ckpt`` path itself runs in test_deepspeed.py, beside DeepSpeed's
process group; these need no DeepSpeed.
"""

from __future__ import annotations

import collections
import logging
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

import datastates
from datastates.client import Client
from datastates.llm import Checkpointing
from datastates.protocol.endpoint import ENDPOINT_ENV
from datastates.protocol.errors import CommitError, InvalidRequestError, WaitTimeout

from conftest import DaemonProc, assert_state_equal, read_only


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> DaemonProc:
    """The module's daemon, found as a job script points trainers at it: ``$DATASTATES_ENDPOINT``."""
    monkeypatch.setenv(ENDPOINT_ENV, shared_daemon_folder.endpoint)
    return shared_daemon_folder


class DeepSpeedConfig:
    """The shape of DeepSpeed's config object that DataStates-LLM's own test builds (datastates_config.config)."""

    class DataStatesConfig:
        def __init__(self, config: dict[str, Any]) -> None:
            self.enabled = True
            self.config = config

    def __init__(self, config: dict[str, Any]) -> None:
        self.datastates_config = self.DataStatesConfig(config)


@pytest.fixture
def engine(daemon: DaemonProc) -> Iterator[Checkpointing]:
    e = Checkpointing(runtime_config={}, rank=0)
    yield e
    e.shutdown()


def test_datastates_llms_own_example_flow(daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:
    """DataStates-LLM's test, as it is written: its config object, save → wait → load, with a torch.Size, a dtype,
    a numpy array and a string in the state. ``load`` right after ``wait()`` (not persisted) waits for the write."""
    config = DeepSpeedConfig({"host_cache_size": 1, "parser_threads": 2, "pin_host_cache": True})
    with caplog.at_level(logging.WARNING, logger="datastates.integrations.datastates_llm"):
        ckpt_engine = Checkpointing(runtime_config=config, rank=0)
    assert "'parser_threads' is ignored" in caplog.text and "'pin_host_cache' is ignored" in caplog.text
    shape, dtype = torch.Size([256, 256]), torch.float32
    ckpt_obj = {
        "tensor1": torch.randn(shape, dtype=dtype),
        "tensor2": torch.randn(shape, dtype=dtype),
        "model_name": "datastates_test_model",
        "rng_iterator": 12345,
        "dtype": dtype,
        "shape": shape,
        "random_np_obj": np.random.randn(512).astype(np.float32),
    }
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ckpt_obj.items()}
    path = str(daemon.root / "llm" / "datastates-ckpt.pt")
    assert ckpt_engine.save(state_dict=ckpt_obj, path=path) is True
    ckpt_engine.wait()
    ckpt_obj["tensor1"].add_(1)  # the state may change once wait() returned: the copy is the daemon's
    assert_state_equal(expected, ckpt_engine.load(path=path))
    del ckpt_engine  # as DataStates-LLM's test ends: the finalizer commits and closes, never raises
    assert datastates.latest(daemon.root) == "llm"


def test_wait_true_positional_commits_and_writes_latest(engine: Checkpointing, daemon: DaemonProc) -> None:
    """``wait(True)``, as DeepSpeed's wrapper calls it: the tag (the global_step folder) is durable and committed."""
    save_dir = daemon.root / "run"
    state = {"w": torch.arange(1000, dtype=torch.float64)}
    engine.save(state, str(save_dir / "global_step7" / "mp_rank_00_model_states.pt"))
    engine.save(state, str(save_dir / "global_step7" / "zero" / "rank_0_optim_states.pt"))  # nested: same tag
    assert datastates.latest(save_dir) is None
    engine.wait(True)
    assert datastates.latest(save_dir) == "global_step7"
    assert (save_dir / "latest").read_text() == "global_step7"
    assert_state_equal(state, engine.load(save_dir / "global_step7" / "zero" / "rank_0_optim_states.pt"))


def test_a_new_tag_commits_the_one_before(engine: Checkpointing, daemon: DaemonProc) -> None:
    """Two saves with no optimizer step between: the second tag's first save commits the first tag."""
    save_dir = daemon.root / "run"
    engine.save({"w": torch.ones(8)}, str(save_dir / "global_step1" / "a.pt"))
    engine.save({"w": torch.full((8,), 2.0)}, str(save_dir / "global_step2" / "a.pt"))
    assert daemon.ctl("wait", "--timeout", "60").returncode == 0
    assert datastates.latest(save_dir) == "global_step1"
    assert engine.commit("global_step2") is True
    assert datastates.latest(save_dir) == "global_step2"


def test_the_optimizer_step_fences_and_commits(engine: Checkpointing, daemon: DaemonProc) -> None:
    """Any optimizer's step waits for the daemon's copy and commits: the file holds the pre-step weights."""
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = collections.OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    engine.save(model.state_dict(), str(daemon.root / "global_step1" / "model.pt"))
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # changes the saved tensors in place, after the hook's fence
    assert not torch.equal(model.weight, before["weight"])
    assert daemon.ctl("wait", "--timeout", "60").returncode == 0  # committed by the step's hook, not by us
    assert datastates.latest(daemon.root) == "global_step1"
    assert_state_equal(before, datastates.load(daemon.root / "global_step1" / "model.pt"))


def test_config_keys_mean_what_they_say(daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(InvalidRequestError, match=r"unknown key\(s\) \['host_cache_sise'\]"):
        Checkpointing({"host_cache_sise": 16})
    with caplog.at_level(logging.WARNING, logger="datastates.integrations.datastates_llm"):
        e = datastates.CheckpointEngine({"datastates_ckpt": {"host_cache_size": 1 << 20, "timeout": 45}}, 3)
    assert "host_cache_size 1.049e+06 GiB asks for more host memory than the node's daemon holds" in caplog.text
    assert e.rank == 3 and e.client.timeout == 45
    with pytest.raises(CommitError, match="no file was saved for it"):
        e.commit("global_step9")
    e.shutdown()
    e.shutdown()  # twice, as DeepSpeed's cleanup and finalizer both end it


def test_a_deepspeed_config_object(daemon: DaemonProc) -> None:
    """DeepSpeed's own config class, as its wrapper passes it: the ``datastates_ckpt`` entry is read."""
    ds_config = pytest.importorskip("deepspeed.runtime.config", reason="DeepSpeed is not installed")
    config = ds_config.DeepSpeedConfig({"train_batch_size": 1, "datastates_ckpt": {"endpoint": daemon.endpoint,
                                                                                  "liveness": 20}})
    e = datastates.CheckpointEngine(config, 0)
    assert e.client.endpoint == daemon.endpoint and e.client._conn.liveness == 20
    e.shutdown()


def test_loads_torch_save_files(engine: Checkpointing, tmp_path: Path) -> None:
    """A job that switched from torch.save resumes from what it wrote before."""
    state = {"w": torch.randn(5), "step": 3}
    torch.save(state, tmp_path / "old.pt")
    assert_state_equal(state, engine.load(str(tmp_path / "old.pt"), map_location=lambda s, loc: s))


def test_a_program_that_never_shuts_down_still_commits(daemon: DaemonProc) -> None:
    """Saved, then the program ends without wait, commit or shutdown: the exit handler commits the tag."""
    code = ("import torch, datastates\n"
            f"e = datastates.CheckpointEngine({{'endpoint': {daemon.endpoint!r}}}, 0)\n"
            f"e.save({{'w': torch.ones(1 << 16)}}, {str(daemon.root / 'global_step5' / 'a.pt')!r})\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert datastates.latest(daemon.root) == "global_step5"


@pytest.mark.parametrize("resave", [False, True])
def test_load_waits_for_a_file_another_rank_is_still_writing(daemon: DaemonProc, engine: Checkpointing,
                                                             resave: bool) -> None:
    """Another process of the node saves a 256 MiB file; this one loads it as soon as the daemon holds its copy:
    ``load`` waits for the daemon to finish writing it instead of failing on a missing file or, when the path was
    committed before (``resave``: the new version is written in the tag's hidden staging folder), reading the old."""
    path = str(daemon.root / "global_step1" / "other_rank.pt")
    before = (f"e.save({{'w': torch.full((64 << 20,), 6.0)}}, {path!r})\n" "e.wait(True)\n") if resave else ""
    # resave: the commit is held a moment once the new version is durable in its staging folder, the window in
    # which ``path`` still holds the old version (a load used to read 6.0 there, 3 runs in 6 under CPU load)
    hold = ("mine = lambda: [s for s in e.client.status()['snapshots'] if s['client'] == e.client.client_id]\n"
            f"while not any(s['path'] != {path!r} and s['state'] == 'durable' for s in mine()): time.sleep(0.01)\n"
            "time.sleep(1)\n") if resave else ""
    code = ("import sys, time, torch, datastates\n"
            "e = datastates.CheckpointEngine({}, 1)\n"
            + before +
            f"e.save({{'w': torch.full((64 << 20,), 7.0)}}, {path!r})\n"
            "e.wait()\n"  # the daemon holds its copy, so it has taken the snapshot in (a STATUS may come first)
            "print('saved', flush=True)\n"
            + hold +
            "e.wait(True)\n")
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "saved"
        w = engine.load(path)["w"]
        wrong = int((w != 7.0).sum())  # a count, never the 64M-element tensor, in a failure's message
        assert (tuple(w.shape), wrong) == ((64 << 20,), 0), f"{wrong} elements are not 7.0; the first is {w[0].item()}"
    finally:
        assert writer.wait(120) == 0


def new_version_durable(c: Client, path: Path) -> dict[str, Any]:
    """The status entry of the new version of committed ``path`` (in its tag's staging folder), once durable."""
    for _ in range(2400):  # a hang guard only
        staged = [s for s in c.status()["snapshots"]
                  if s["tag"] == path.parent.name and s["path"] != str(path) and s["path"].endswith(path.name)]
        if staged and staged[-1]["state"] == "durable":
            return staged[-1]
        time.sleep(0.05)
    raise AssertionError(f"no new version of {path} became durable: {staged}")


def test_load_returns_the_committed_version_while_a_resave_whose_commit_failed_waits_for_a_retry(
        start_daemon: Callable[..., DaemonProc]) -> None:
    """A re-save of global_step1 is durable in its staging folder, and its commit fails
    (the root read-only when the marker is written); the daemon keeps it for a retry, staging folder and all. ``load``
    returns the committed version, instead of polling the daemon's status for ever."""
    d = start_daemon()
    path = d.root / "global_step1" / "model_states.pt"
    old = {"w": torch.full((1000,), 1.0)}
    engine = Checkpointing(runtime_config={"endpoint": d.endpoint}, rank=0)
    try:
        engine.save(old, path)
        engine.wait(True)
        engine.save({"w": torch.full((1000,), 2.0)}, path)
        engine.wait()
        new_version_durable(engine.client, path)
        with read_only(d.root):
            with pytest.raises(CommitError, match="read-only"):
                engine.wait(True)
        assert new_version_durable(engine.client, path)["commit"] == "failed"
        loading = ThreadPoolExecutor(1).submit(engine.load, str(path))
        try:
            got = loading.result(timeout=120)  # a hang guard: it returns at once
        except TimeoutError:
            raise AssertionError("load() waits for a new version whose commit failed, which may never be retried")
        assert_state_equal(old, got)
    finally:
        engine.shutdown()


def test_load_gives_up_on_a_new_version_whose_commit_never_comes_naming_it(daemon: DaemonProc, engine: Checkpointing) -> None:
    """Another client of the node re-saved the file and never commits it: ``load`` waits at most ``load_timeout``,
    then raises WaitTimeout naming the path and the version it waited for."""
    path = daemon.root / "never" / "global_step1" / "never_committed.pt"
    with Client(daemon.endpoint) as other:
        other.snapshot({"w": torch.full((8,), 1.0)}, path)
        other.commit("global_step1").result(timeout=60)
        other.snapshot({"w": torch.full((8,), 2.0)}, path)
        other.wait()
        staged = new_version_durable(other, path)
        engine.load_timeout = 1.0
        with pytest.raises(WaitTimeout, match="never_committed.pt") as waited:
            engine.load(path)
        assert staged["path"] in waited.value.message and "commit open" in waited.value.message
