"""Restoring into CUDA tensors in place (client/reader/restore.py), through a real daemon.

The bytes of a storage that one contiguous CUDA tensor of ``into`` covers go from the read
(the daemon's replica, mapped, or storage, read with O_DIRECT) through the read thread's
page-locked buffer straight into that tensor: the tensor keeps its memory (same object,
same ``data_ptr``), and no fresh GPU memory of the state's size is taken, even for a moment
(``max_memory_allocated``). The reader's piece size is lowered so that each of its threads
copies many pieces through its one page-locked buffer: a buffer refilled before its
previous piece's asynchronous copy finished would show as wrong bytes here.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import datastates
import datastates.client.reader.stream as stream_module
from datastates.client import Client

from conftest import DaemonFactory, DaemonProc, save

PIECE = 1 << 20
"""The reader's piece size in these tests: ~40 pieces, ten per read thread."""
ROUNDS = 3
"""Restores of the same file into the same tensors, zeroed in between: a race between a buffer's refill and its
previous copy has several chances to show."""


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    """One daemon for the module, with 256 KiB pieces: the reader's pieces are whole ones of the file's, so the
    lowered ``PIECE`` holds."""
    factory = DaemonFactory(tmp_path_factory.mktemp("gpu-into"))
    yield factory.start(chunk_size=f"{256 << 10}B")
    factory.stop_all_later()


@pytest.fixture
def daemon(node: DaemonProc, request: pytest.FixtureRequest) -> DaemonProc:
    """The module's daemon, with a storage folder of this test's own as its root."""
    root = node.root / request.node.name.replace("[", "-").replace("]", "")
    root.mkdir()
    return dataclasses.replace(node, root=root)


@pytest.fixture
def trainer(daemon: DaemonProc) -> Iterator[Client]:
    c = Client(daemon.endpoint, timeout=60)
    yield c
    c.close()


def cpu_state() -> dict[str, Any]:
    """~40 MB of odd sizes (storages straddle the read pieces), and the layouts that go through a CPU buffer
    instead (a transposed tensor, two views of one storage)."""
    torch.manual_seed(0)
    shared = torch.randn(5000)
    return {"big": torch.randn(7_000_001), "mid": torch.randn(2_500_000), "bf16": torch.randn(1_234_567).bfloat16(),
            "i64": torch.randint(-2**62, 2**62, (300_001,)), "bool": torch.rand(100_003) > 0.5,
            "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "t": torch.randn(300, 200).t(),
            "shared": shared, "tail": shared[7:], "step": 9}


def cuda_into(state: dict[str, Any]) -> dict[str, Any]:
    """``state``'s structure as zeroed CUDA tensors of the same shapes and strides (views apart)."""
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda").zero_()
            if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def wait_for_replica(c: Client, path: Path) -> None:
    for _ in range(2400):  # a hang guard: the replica may land after the commit's reply
        if any(r["path"] == str(path) and r["committed"] and Path(r["file"]).exists()
               for r in c.status()["replicas"]["replicas"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"the daemon never held a replica of {path}")


@pytest.mark.parametrize("source", ["memory", "storage"])
def test_a_restore_fills_cuda_tensors_in_place_bitwise_with_no_gpu_staging(
        source: str, trainer: Client, daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    state = cpu_state()
    path = daemon.root / "step1" / "rank0.pt"
    save(trainer, state, path, tag="step1")
    if source == "storage":  # a newer commit of the rank file: step1's replica goes, its restore reads storage
        save(trainer, {"other": torch.zeros(1)}, daemon.root / "step2" / "rank0.pt", tag="step2")
    else:
        wait_for_replica(trainer, path)
    monkeypatch.setattr(stream_module, "READ_PIECE", PIECE)
    into = cuda_into(state)
    ptrs = {k: (id(v), v.data_ptr()) for k, v in into.items() if isinstance(v, torch.Tensor)}
    for round in range(ROUNDS):
        for v in into.values():
            if isinstance(v, torch.Tensor):
                v.zero_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        restored = trainer.restore(daemon.root, "rank0.pt", tag="step1", into=into)
        peak = torch.cuda.max_memory_allocated() - before
        assert restored is not None and restored.source == source and restored.state is into, restored
        assert {k: (id(v), v.data_ptr()) for k, v in into.items() if isinstance(v, torch.Tensor)} == ptrs
        assert peak < nbytes(state) // 20, f"round {round}: {peak} bytes of GPU memory taken for a restore in place"
        unequal = [k for k, v in state.items() if isinstance(v, torch.Tensor) and not torch.equal(into[k].cpu(), v)]
        assert unequal == [] and into["step"] == 9, f"round {round}: wrong bytes in {unequal}"
        assert into["t"].stride() == state["t"].stride()


def test_a_models_cuda_parameters_are_restored_in_place(trainer: Client, daemon: DaemonProc) -> None:
    """``into=model.state_dict()`` of a CUDA model whose parameters require grad, from ``datastates.load``."""
    torch.manual_seed(1)
    saved = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 256)).state_dict()
    path = daemon.root / "model" / "rank0.pt"
    save(trainer, saved, path, tag="model")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(512, 1024), nn.LayerNorm(1024), nn.Linear(1024, 256)).cuda()
    params = {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()}
    datastates.load(path, into=model.state_dict())
    assert {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()} == params
    for k, p in model.named_parameters():
        assert p.requires_grad and p.is_leaf and torch.equal(p.detach().cpu(), saved[k]), k


def test_a_restore_lands_after_the_work_the_job_queued_on_into(
        trainer: Client, daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's last kernels on ``into`` may still be queued on its current stream when the restore begins (a model
    built on the GPU, its initializers asynchronous, nothing synchronized): the restore's copies, on the read threads'
    own streams, must land after them. Else the queued kernel writes over the restored bytes, after ``load``
    returned success. The current stream is held busy (``torch.cuda._sleep``) so that the queued fill surely runs
    after an unordered restore's copies."""
    torch.manual_seed(3)
    state = {"w": torch.randn(8_000_000)}
    path = daemon.root / "queued" / "rank0.pt"
    save(trainer, state, path, tag="queued")
    monkeypatch.setattr(stream_module, "READ_PIECE", PIECE)
    into = {"w": torch.empty(8_000_000, device="cuda")}
    torch.cuda.synchronize()
    torch.cuda._sleep(5_000_000_000)  # some seconds of the current stream's time, queued
    into["w"].fill_(7.0)  # the job's last write to it, queued behind
    datastates.load(path, into=into)
    torch.cuda.synchronize()
    wrong = int((into["w"].cpu() != state["w"]).sum())
    assert wrong == 0, f"{wrong} elements are not the checkpoint's"
