"""DatastatesCheckpointEngine against DeepSpeed itself: its base class, its call order, and its engine on the CPU."""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the CPU accelerator, without DeepSpeed's warning that it found no GPU
deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.deepspeed import DatastatesCheckpointEngine  # noqa: E402
from datastates.protocol.endpoint import ENDPOINT_ENV  # noqa: E402
from datastates.protocol.errors import CommitError, InvalidRequestError  # noqa: E402
from datastates.protocol.format import marker_name  # noqa: E402

from conftest import DaemonProc, addresses, assert_state_equal, watch_loads  # noqa: E402


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder

MODEL_FILE = "mp_rank_00_model_states.pt"
OPTIM_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


def ds_states(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DeepSpeed's engine saves for one rank: tensors among args, enums, lists, ints and its config."""
    g = torch.Generator().manual_seed(seed)
    module = collections.OrderedDict(
        [("0.weight", torch.randn(16, 8, generator=g)), ("0.bias", torch.randn(16, generator=g)),
         ("1.weight", torch.randn(4, 16, generator=g).to(torch.bfloat16))]
    )
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 1}}
    model_states = {
        "module": module,
        "buffer_names": [],
        "optimizer": None,
        "param_shapes": [collections.OrderedDict((k, v.shape) for k, v in module.items())],
        "lr_scheduler": {"last_epoch": 3, "_last_lr": [1e-3]},
        "global_steps": 3,
        "global_samples": 3,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_config": config,
        "ds_version": deepspeed.__version__,
        "args": argparse.Namespace(lr=1e-3, seed=seed),
    }
    optim_states = {
        "optimizer_state_dict": {
            "zero_stage": ZeroStageEnum.optimizer_states,
            "loss_scaler": None,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(324, generator=g),
                              "exp_avg_sq": torch.rand(324, generator=g)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
            },
            "single_partition_of_fp32_groups": [torch.randn(324, generator=g)],
            "partition_count": [1],
        },
        "ds_config": config,
        "ds_version": deepspeed.__version__,
    }
    return model_states, optim_states


def checkpoint(engine: DatastatesCheckpointEngine, save_dir: Path, tag: str, seed: int) -> tuple[dict, dict]:
    """create → makedirs → save the model file → save the optimizer file, as ``save_checkpoint`` calls them."""
    model_states, optim_states = ds_states(seed)
    engine.create(CheckpointCommitInfo(tag=tag, save_dir=str(save_dir), save_latest=True))
    engine.makedirs(str(save_dir / tag), exist_ok=True)
    engine.save(model_states, str(save_dir / tag / MODEL_FILE))
    engine.save(optim_states, str(save_dir / tag / OPTIM_FILE))
    return model_states, optim_states


@pytest.fixture
def ds_engine(daemon: DaemonProc) -> Iterator[DatastatesCheckpointEngine]:
    engine = DatastatesCheckpointEngine(endpoint=daemon.endpoint, timeout=60)
    yield engine
    engine.cleanup()


def test_a_real_deepspeed_checkpoint_engine() -> None:
    """Every abstract method of DeepSpeed's base is implemented; constructing it connects to nothing yet."""
    assert issubclass(DatastatesCheckpointEngine, CheckpointEngine)
    assert not DatastatesCheckpointEngine.__abstractmethods__
    engine = DatastatesCheckpointEngine(None, endpoint="ipc:///nonexistent/datastatesd.sock")
    assert isinstance(engine, CheckpointEngine)
    assert engine.name == "DatastatesCheckpointEngine"
    assert not engine.is_decoupled() and DatastatesCheckpointEngine(decoupled=True).is_decoupled()
    assert engine.get_commit_info() is None
    engine.cleanup()


def test_saved_as_deepspeed_calls_it_loads_bitwise(ds_engine: DatastatesCheckpointEngine, daemon: DaemonProc) -> None:
    save_dir = daemon.root / "ds"
    model_states, optim_states = checkpoint(ds_engine, save_dir, "global_step3", seed=1)
    assert ds_engine.commit(CheckpointCommitInfo(tag="global_step3", save_dir=str(save_dir), save_latest=True)) is True
    assert datastates.latest(save_dir) == "global_step3"
    assert_state_equal(model_states, ds_engine.load(str(save_dir / "global_step3" / MODEL_FILE)))
    assert_state_equal(optim_states, ds_engine.load(str(save_dir / "global_step3" / OPTIM_FILE), torch.device("cpu")))
    # DeepSpeed's state-dict loaders pass a callable that keeps storages where they are
    assert_state_equal(model_states, ds_engine.load(str(save_dir / "global_step3" / MODEL_FILE), lambda s, loc: s))


def ds_module(bias: bool = False) -> torch.nn.Module:
    """A module whose state dict has ``ds_states``' keys, shapes and dtypes (with ``bias``, one key more)."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=bias))
    module[1].to(torch.bfloat16)
    return module


def test_with_the_model_its_module_is_read_into_the_modules_own_tensors(
        ds_engine: DatastatesCheckpointEngine, daemon: DaemonProc, caplog: pytest.LogCaptureFixture) -> None:
    """model=: the model states file's ``module`` goes into the module's own tensors and the state handed back
    holds them. The optimizer file (no ``module``) and a module that does not fit (one key more) are read fresh,
    the module left untouched: DeepSpeed then loads them as before."""
    save_dir = daemon.root / "ds"
    model_states, optim_states = checkpoint(ds_engine, save_dir, "global_step3", seed=1)
    ds_engine.commit(CheckpointCommitInfo(tag="global_step3", save_dir=str(save_dir), save_latest=True))
    module = ds_module()
    where = addresses(module)
    loader = DatastatesCheckpointEngine(model=module)
    state = loader.load(str(save_dir / "global_step3" / MODEL_FILE), lambda s, loc: s)
    assert_state_equal(model_states, state)
    assert addresses(module) == where and {k: v.data_ptr() for k, v in state["module"].items()} == where
    assert_state_equal(model_states["module"], module.state_dict())
    assert_state_equal(optim_states, loader.load(str(save_dir / "global_step3" / OPTIM_FILE)))
    assert not caplog.records  # a file without ``module`` is simply read fresh

    other = ds_module(bias=True)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with caplog.at_level("WARNING"):
        state = DatastatesCheckpointEngine(model=other).load(str(save_dir / "global_step3" / MODEL_FILE))
    assert_state_equal(model_states, state)
    assert_state_equal(before, dict(other.state_dict()))
    assert "read fresh" in caplog.text and "['module']['1.bias']" in caplog.text, caplog.text


def test_decoupled_commits_at_deepspeeds_next_step_or_save_or_cleanup(daemon: DaemonProc) -> None:
    """Decoupled: nothing commits in save_checkpoint; the step (get_commit_info → commit), a new create or cleanup does."""
    engine = DatastatesCheckpointEngine(endpoint=daemon.endpoint, timeout=60, decoupled=True)
    save_dir = daemon.root / "ds"
    checkpoint(engine, save_dir, "global_step1", seed=1)
    info = engine.get_commit_info()
    assert info is not None and info.tag == "global_step1"
    assert datastates.latest(save_dir) is None
    assert engine.commit(info) is True  # what DeepSpeed's _commit_decoupled_checkpoint does before the optimizer step
    assert engine.get_commit_info() is None and datastates.latest(save_dir) == "global_step1"

    checkpoint(engine, save_dir, "global_step2", seed=2)
    expected = checkpoint(engine, save_dir, "global_step3", seed=3)  # two saves with no step between
    assert datastates.latest(save_dir) == "global_step2"
    engine.cleanup()  # engine.destroy() calls it for a decoupled engine
    assert datastates.latest(save_dir) == "global_step3"
    assert_state_equal(expected[1], engine.load(str(save_dir / "global_step3" / OPTIM_FILE)))


def test_out_of_order_calls_are_refused(ds_engine: DatastatesCheckpointEngine, daemon: DaemonProc) -> None:
    save_dir = daemon.root / "ds"
    with pytest.raises(InvalidRequestError, match="create"):
        ds_engine.save({"w": torch.zeros(2)}, str(save_dir / "global_step1" / MODEL_FILE))
    with pytest.raises(InvalidRequestError, match="invalid tag"):
        ds_engine.create(CheckpointCommitInfo(tag="step 1/2", save_dir=str(save_dir), save_latest=True))
    checkpoint(ds_engine, save_dir, "global_step1", seed=1)
    with pytest.raises(CommitError, match="global_step2"):
        ds_engine.commit(CheckpointCommitInfo(tag="global_step2", save_dir=str(save_dir), save_latest=True))
    ds_engine.commit(CheckpointCommitInfo(tag="global_step1", save_dir=str(save_dir), save_latest=True))
    with pytest.raises(CommitError, match="None"):
        ds_engine.commit(CheckpointCommitInfo(tag="global_step1", save_dir=str(save_dir), save_latest=True))


def test_loads_what_deepspeeds_torch_engine_wrote(tmp_path: Path) -> None:
    """A job that switches engines resumes from the checkpoints torch.save wrote before, with the model or without."""
    model_states, _ = ds_states(seed=5)
    path = tmp_path / MODEL_FILE
    torch.save(model_states, path)
    assert_state_equal(model_states, DatastatesCheckpointEngine().load(str(path), lambda s, loc: s))
    module = ds_module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert_state_equal(model_states, DatastatesCheckpointEngine(model=module).load(str(path), lambda s, loc: s))
    assert_state_equal(before, dict(module.state_dict()))  # torch.load's fresh tensors: DeepSpeed copies them in


def test_datastates_never_needs_deepspeed() -> None:
    """Without DeepSpeed, datastates imports and this module says what is missing."""
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import datastates, datastates.client, datastates.integrations\n"
        "try:\n"
        "    import datastates.integrations.deepspeed\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "needs DeepSpeed (pip install deepspeed)" in out.stdout, out.stdout + out.stderr


# -- DeepSpeed's engine, end to end ------------------------------------------------------


@pytest.fixture(scope="module")
def ds_dist() -> Iterator[None]:
    """A gloo process group of one, as the ``deepspeed`` launcher would set up for a single rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0",
                            "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}.items():
            mp.setenv(name, value)
        # DeepSpeed builds a C++ shared-memory allreduce on the CPU at init (minutes, and useless for one
        # rank); its op table is cached in the module so that edits like this one persist
        mp.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", False)
        deepspeed.init_distributed(dist_backend="gloo")
        yield
        torch.distributed.destroy_process_group()


def ds_initialize(seed: int, stage: int = 1, **extra: Any) -> Any:
    """A tiny model under ZeRO ``stage`` with torch's Adam (DeepSpeed's FusedAdam would compile a CPU op);
    ``extra``: more config entries (``datastates_ckpt``)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    config = {"train_batch_size": 1, "zero_optimization": {"stage": stage}, "steps_per_print": 1 << 30, **extra}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def one_rank_job(endpoint: str, **datastates_ckpt: Any) -> Any:
    """The engine of a one-rank job in this process (a job script's), its process group and endpoint set up as
    torchrun and a job script would: ``ds_initialize(seed=0)`` with ``datastates_ckpt``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({ENDPOINT_ENV: endpoint, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the ds_dist fixture
    deepspeed.init_distributed(dist_backend="gloo")
    return ds_initialize(seed=0, datastates_ckpt=datastates_ckpt)


def assert_resumes(d: DaemonProc, save_dir: Path, expected: Path, steps: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh engine of another seed loads ``save_dir``'s newest checkpoint: ``steps`` steps, the state in
    ``expected`` (``torch.save``d by the job) bitwise."""
    monkeypatch.setenv(ENDPOINT_ENV, d.endpoint)
    fresh = ds_initialize(seed=1, datastates_ckpt={})
    fresh.load_checkpoint(str(save_dir))
    assert fresh.global_steps == steps
    assert_state_equal(torch.load(expected), snapshot_of(fresh))
    fresh.destroy()


def train_step(engine: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = engine(torch.randn(1, 8, generator=g)).square().sum()
    engine.backward(loss)
    engine.step()


def snapshot_of(engine: Any) -> tuple[dict, dict]:
    """The parameters and the optimizer's fp32 master state, cloned."""
    params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer.state_dict()
    master = [t.clone() for t in opt["single_partition_of_fp32_groups"]]
    moments = {k: v.clone() for k, v in opt["base_optimizer_state"]["state"][0].items()}
    return params, {"master": master, "moments": moments}


@pytest.mark.parametrize("decoupled, in_place", [(False, True), (True, False)], ids=["in-place", "decoupled-fresh"])
def test_deepspeed_save_and_load_checkpoint(ds_dist: None, daemon: DaemonProc, decoupled: bool, in_place: bool) -> None:
    """Saved and loaded through DeepSpeed's engine, bitwise. ``in_place``: the loading engine is given the model, and
    DeepSpeed's ``load_state_dict`` is handed the module's own tensors, already holding the file's values."""
    save_dir = daemon.root / "ds"
    engine = ds_initialize(seed=0)
    engine.checkpoint_engine = DatastatesCheckpointEngine(endpoint=daemon.endpoint, timeout=60, decoupled=decoupled)
    for step in range(2):
        train_step(engine, seed=step)
    saved = snapshot_of(engine)
    engine.save_checkpoint(str(save_dir), tag="global_step2", client_state={"epoch": 7, "args": argparse.Namespace(x=1)})
    if decoupled:
        assert datastates.latest(save_dir) is None  # the tag waits for the next step, the fence
        train_step(engine, seed=2)
    assert datastates.latest(save_dir) == "global_step2"
    assert sorted(p.name for p in (save_dir / "global_step2").glob("*.pt")) == [MODEL_FILE, OPTIM_FILE]
    assert (save_dir / "latest").read_text() == "global_step2"
    engine.checkpoint_engine.cleanup()
    engine.destroy()

    fresh = ds_initialize(seed=1)
    fresh.checkpoint_engine = DatastatesCheckpointEngine(endpoint=daemon.endpoint, timeout=60,
                                                         model=fresh if in_place else None)
    where, loads = addresses(fresh.module), watch_loads(fresh.module)
    path, client_state = fresh.load_checkpoint(str(save_dir))  # the tag from DeepSpeed's own 'latest' file
    assert path == str(save_dir / "global_step2" / MODEL_FILE)
    assert client_state["epoch"] == 7 and client_state["args"] == argparse.Namespace(x=1)
    assert fresh.global_steps == 2
    assert_state_equal(saved, snapshot_of(fresh))
    assert addresses(fresh.module) == where
    assert loads == [(len(where) if in_place else 0, len(where))], loads
    fresh.checkpoint_engine.cleanup()
    fresh.destroy()


@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeeds_zero_to_fp32_consolidates_what_we_wrote(ds_dist: None, daemon: DaemonProc, stage: int) -> None:
    """DeepSpeed's own offline tool (``zero_to_fp32.py``, which it copies into every checkpoint folder) reads our
    files with plain ``torch.load``: the fp32 weights it consolidates are the ones the engine held."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    save_dir = daemon.root / f"zero{stage}"
    engine = ds_initialize(seed=0, stage=stage)
    engine.checkpoint_engine = DatastatesCheckpointEngine(endpoint=daemon.endpoint, timeout=60)
    train_step(engine, seed=0)
    weights = {k: v.detach().clone().float() for k, v in engine.module.state_dict().items()}
    engine.save_checkpoint(str(save_dir), tag="global_step1")
    engine.checkpoint_engine.cleanup()
    engine.destroy()
    assert datastates.latest(save_dir) == "global_step1"

    consolidated = get_fp32_state_dict_from_zero_checkpoint(str(save_dir), tag="global_step1")
    assert_state_equal(weights, {k: v.detach() for k, v in consolidated.items()})


# -- DeepSpeed's own datastates_ckpt config entry ------------------------------------------


@pytest.mark.parametrize("stage", [1, 2])
def test_the_config_entry_alone_switches_a_job(ds_dist: None, daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch,
                                                stage: int) -> None:
    """``"datastates_ckpt": {}`` and ``$DATASTATES_ENDPOINT``, nothing else: DeepSpeed's wrapper drives
    datastates.CheckpointEngine. Training steps right after each save, yet each tag holds its pre-step state, and
    each is committed (marker and ``latest``) by the next step or the next save, not only at exit."""
    monkeypatch.setenv(ENDPOINT_ENV, daemon.endpoint)
    save_dir = daemon.root / f"config{stage}"
    engine = ds_initialize(seed=0, stage=stage, datastates_ckpt={})
    assert isinstance(engine.checkpoint_engine.ckpt_engine, datastates.CheckpointEngine)
    for step in range(2):
        train_step(engine, seed=step)
    first = snapshot_of(engine)
    engine.save_checkpoint(str(save_dir))  # global_step2
    train_step(engine, seed=2)  # at once: its pre-step hook fences, then commits global_step2
    assert daemon.ctl("wait", "--timeout", "60").returncode == 0
    assert datastates.latest(save_dir) == "global_step2" and (save_dir / "latest").read_text() == "global_step2"
    second = snapshot_of(engine)
    engine.save_checkpoint(str(save_dir))  # global_step3, committed by destroy's cleanup
    engine.destroy()
    assert datastates.latest(save_dir) == "global_step3" and (save_dir / "latest").read_text() == "global_step3"
    assert daemon.ctl("verify", str(save_dir / "global_step3")).returncode == 0

    fresh = ds_initialize(seed=1, stage=stage, datastates_ckpt={})
    fresh.load_checkpoint(str(save_dir))  # the tag from DeepSpeed's own 'latest' file
    assert fresh.global_steps == 3
    assert_state_equal(second, snapshot_of(fresh))
    fresh.load_checkpoint(str(save_dir), tag="global_step2")
    assert_state_equal(first, snapshot_of(fresh))
    fresh.destroy()


def test_a_job_killed_between_two_saves_resumes_from_the_first(ds_dist: None, daemon: DaemonProc, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """kill -9 right after the second save_checkpoint returned: that tag never commits, the first one did (at
    the step between them), and load_checkpoint resumes from it bitwise."""
    save_dir, expected = daemon.root / "killed", tmp_path / "expected.pt"
    job = Path(__file__).with_name("ds_killed_job.py")
    proc = subprocess.run([sys.executable, str(job), daemon.endpoint, str(save_dir), str(expected)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    done = daemon.ctl("wait", "--timeout", "60")  # reports global_step3's snapshots, failed with their trainer
    assert "still pending" not in done.stderr and "global_step2" not in done.stdout + done.stderr, done.stderr
    assert datastates.latest(save_dir) == "global_step2"

    assert_resumes(daemon, save_dir, expected, 2, monkeypatch)


@pytest.mark.heavy
def test_a_job_goes_on_checkpointing_after_its_daemon_stalled_past_liveness(
        ds_dist: None, start_daemon: Callable[..., DaemonProc], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon is stopped (SIGSTOP) while global_step3's snapshots wait for it, past the client's liveness, then
    resumed. The job is told once, by one warning naming global_step3 lost, and never by an exception: its later
    steps and saves succeed (the client connects again, as a new client), global_step5 commits and loads bitwise,
    and nothing is printed at exit."""
    d = start_daemon()
    save_dir, expected = d.root / "stalled", tmp_path / "expected.pt"
    job = subprocess.Popen([sys.executable, str(Path(__file__).with_name("ds_stalled_job.py")), d.endpoint,
                            str(save_dir), str(expected)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        for said, then in (("stall", signal.SIGSTOP), ("lost", signal.SIGCONT)):
            while (line := job.stdout.readline()) and line.strip() != said:  # DeepSpeed prints on stdout too
                pass
            assert line, f"the job ended before it said {said!r}: {job.stderr.read()[-4000:]}"
            d.proc.send_signal(then)
            job.stdin.write("go\n")
            job.stdin.flush()
        out, err = job.communicate(timeout=240)
    finally:
        d.proc.send_signal(signal.SIGCONT)
        job.kill()
    assert job.returncode == 0 and "done" in out, err[-4000:]
    told = [line for line in err.splitlines() if "global_step3" in line]
    assert len(told) == 1 and "lost" in told[0] and "no sign of life" in told[0], err[-4000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-4000:]
    assert datastates.latest(save_dir) == "global_step5" and (save_dir / "latest").read_text() == "global_step5"
    assert not (save_dir / "global_step3" / marker_name("global_step3")).exists()
    assert d.ctl("verify", str(save_dir / "global_step5")).returncode == 0

    assert_resumes(d, save_dir, expected, 5, monkeypatch)


@pytest.mark.heavy
def test_two_ranks_each_commit_the_config_entrys_tags(daemon: DaemonProc, tmp_path: Path) -> None:
    """torchrun, 2 ranks, ZeRO 2, only the config entry: each rank's step hook commits its files, the daemon marks the
    tag committed once both have (the model file of rank 0, an optimizer partition each), and a fresh 2-rank job
    resumes every rank's partition bitwise from ``latest`` and from the earlier tag."""
    save_dir = daemon.root / "ranks"
    job = Path(__file__).with_name("ds_ranks_job.py")
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")  # ds_dist's
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, ENDPOINT_ENV: daemon.endpoint,
           "OMP_NUM_THREADS": "1"}
    for mode in ("train", "resume"):
        run = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
                              str(job), mode, str(save_dir), str(tmp_path)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0 and run.stdout.count(f"{mode} ok") == 2, run.stdout + run.stderr
        if mode == "train":
            assert datastates.latest(save_dir) == "global_step3" and (save_dir / "latest").read_text() == "global_step3"
            files = sorted(p.name for p in (save_dir / "global_step3").glob("*.pt"))
            assert files == [MODEL_FILE, OPTIM_FILE, OPTIM_FILE.replace("pp_rank_0", "pp_rank_1")]
            assert daemon.ctl("verify", str(save_dir / "global_step3")).returncode == 0
