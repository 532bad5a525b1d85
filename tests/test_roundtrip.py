"""A trainer's real checkpoint goes through the daemon and comes back bit for bit.

The state is what DeepSpeed-style trainers save: a small GPT with a tied lm_head, an
AdamW state after real steps, a bf16 copy of the weights, and the RNG states and plain
objects a resume needs.
"""

from __future__ import annotations

import collections
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import datastates
from datastates.client import Client
from datastates.protocol.providers.pickled import training_globals

from conftest import DaemonProc, assert_state_equal, assert_tensor_bitwise, load_both, same_storage, temp_files


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.fc2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as GPT-2 does

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def train_step(model: TinyGPT, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()


def trained(steps: int = 2) -> tuple[TinyGPT, torch.optim.AdamW]:
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        train_step(model, opt, step)
    return model, opt


def trainer_state(model: TinyGPT, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a trainer checkpoints: weights (fp32 and a bf16 copy), optimizer, RNGs, counters, odds and ends."""
    random.seed(step)
    np.random.seed(step)
    return {
        "module": model.state_dict(),
        "bf16_module": collections.OrderedDict((k, v.detach().to(torch.bfloat16)) for k, v in model.state_dict().items()),
        "optimizer": opt.state_dict(),
        "global_step": step,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "data_order": np.arange(20, dtype=np.int32)[::-1].copy(),
        "meta": {"ds_version": "0.14", "dims": (VOCAB, DIM), "layers": [f"block{i}" for i in range(LAYERS)],
                 "lr_schedule": collections.OrderedDict(warmup=10, decay="cosine"), "none": None},
    }


def clone_state(state: Any) -> Any:
    """A deep copy whose tensors keep dtype, shape and stride: the expected values after later in-place changes."""
    if isinstance(state, torch.Tensor):
        copy = torch.empty_strided(state.shape, state.stride(), dtype=state.dtype).copy_(state)
        return copy.requires_grad_(state.requires_grad)
    if isinstance(state, dict):
        return type(state)((k, clone_state(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(clone_state(v) for v in state)
    return state


def test_trainer_state_roundtrips_bitwise(client: Client, daemon: DaemonProc) -> None:
    """Everything a resume needs comes back bitwise, tied weights stay tied, and training resumes on the same path."""
    model, opt = trained()
    state = trainer_state(model, opt, step=10)
    assert all({"step", "exp_avg", "exp_avg_sq"} <= set(s) for s in state["optimizer"]["state"].values())
    path = daemon.root / "global_step10" / "mp_rank_00_model_states.pt"

    handle = client.snapshot(state, path)  # tag defaults to the folder name
    assert handle.tag == "global_step10"
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(state)}
    assert handle.nbytes == sum(unique.values()), "the tied weight's storage is sent once"
    client.wait()
    committed = client.commit("global_step10").result(timeout=120)
    assert committed.files == [str(path)]
    assert Path(committed.marker).is_file()

    loaded = load_both(path)
    assert_state_equal(state, loaded)
    assert same_storage(loaded["module"]["embed.weight"], loaded["module"]["lm_head.weight"])
    assert not same_storage(loaded["module"]["embed.weight"], loaded["bf16_module"]["embed.weight"])
    with torch.serialization.safe_globals(training_globals()):  # numpy's RNG state, as for a torch.save file
        plain = torch.load(path, weights_only=True, mmap=True)
    assert same_storage(plain["module"]["embed.weight"], plain["module"]["lm_head.weight"])
    assert datastates.latest(daemon.root) == "global_step10"
    assert temp_files(daemon.root) == []

    # Resume from the file: one more step on both sides gives the same weights, bit for bit.
    np.random.set_state(loaded["rng"]["numpy"])
    random.setstate(loaded["rng"]["python"])
    assert (np.random.randint(0, 1 << 30), random.random()) == _draws_after_seed(10)
    resumed = TinyGPT()
    resumed.load_state_dict(loaded["module"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    resumed_opt.load_state_dict(loaded["optimizer"])
    train_step(model, opt, 2)
    train_step(resumed, resumed_opt, 2)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert_tensor_bitwise(a, b, name)


def _draws_after_seed(seed: int) -> tuple[int, float]:
    np.random.seed(seed)
    random.seed(seed)
    return np.random.randint(0, 1 << 30), random.random()


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def test_changes_after_wait_do_not_reach_the_file(client: Client, daemon: DaemonProc) -> None:
    """wait() is the contract: once it returns the optimizer may step in place, and the file keeps the values of the snapshot."""
    model, opt = trained()
    state = {"module": model.state_dict(), "optimizer": opt.state_dict()}
    expected = clone_state(state)
    path = daemon.root / "global_step2" / "mp_rank_00_model_states.pt"

    client.snapshot(state, path)
    client.wait()
    train_step(model, opt, 2)  # in place: parameters, exp_avg, exp_avg_sq and step all change
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(state["module"]["ln_f.weight"], expected["module"]["ln_f.weight"])
    assert not torch.equal(state["optimizer"]["state"][0]["exp_avg"], expected["optimizer"]["state"][0]["exp_avg"])
    client.commit("global_step2").result(timeout=120)

    assert_state_equal(expected, load_both(path))


def test_a_state_sent_again_is_written_whole_and_a_changed_one_as_it_now_is(client: Client, daemon: DaemonProc) -> None:
    """The daemon keeps what it decoded and planned of a long state (protocol/messages.py, protocol/layout.py) to
    reuse it when the same state comes again: each file must still hold the state as sent, whether its values
    changed, a tensor's shape or dtype changed, only a storage's size changed (the same views of a larger storage),
    or an older structure comes back; with tags of differing lengths, which move the data region."""
    def state(kind: str, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {f"t{i}": torch.randn(4, generator=g) for i in range(2000)}
        if kind in ("reshaped", "wider"):
            out["t1000"] = torch.randn(2, 2, dtype=torch.float64, generator=g)
        if kind == "wider":
            out["t5"] = torch.randn(8, generator=g)[:4]
        return out

    rounds = [("same", 1, "s1"), ("same", 2, "step_two"), ("reshaped", 3, "s3"), ("wider", 4, "s4"),
              ("same", 5, "a_rather_longer_tag_5")]
    for kind, seed, tag in rounds:
        sent = state(kind, seed)
        path = daemon.root / tag / "rank0.pt"
        client.snapshot(sent, path)
        client.wait()
        client.commit(tag).result(timeout=120)
        loaded = load_both(path)
        assert_state_equal(state(kind, seed), loaded, f"{kind}/{tag}")
        if kind == "wider":  # the whole storage is saved, as torch.save saves it: not only the view's bytes
            whole = torch.empty(0).set_(loaded["t5"].untyped_storage())
            assert whole.numel() == 8 and torch.equal(whole, torch.empty(0).set_(sent["t5"].untyped_storage()))


CLIENT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from datastates.client import Client

    endpoint, path, reference, mode = sys.argv[1:]
    torch.manual_seed(7)
    state = {"w": torch.randn(256, 64), "b": torch.randn(64).to(torch.bfloat16), "step": 42,
             "ids": torch.arange(1000, dtype=torch.int64)[::3]}
    torch.save(state, reference)
    client = Client(endpoint, timeout=60, name="separate-process")
    client.snapshot(state, path)
    client.wait()
    if mode == "commit":
        print(client.commit("global_step42").result(timeout=120).marker)
        client.close()
    else:
        os._exit(0)  # gone without a word: the daemon already holds its own copy
    """
)


@pytest.mark.parametrize("mode", ["commit", "exit-after-wait"])
def test_snapshot_from_another_process(daemon: DaemonProc, tmp_path: Path, mode: str) -> None:
    """The daemon serves a trainer in another process; its file outlives that process, committed or not."""
    script = tmp_path / "trainer.py"
    script.write_text(CLIENT_SCRIPT)
    path = daemon.root / "global_step42" / "model_states.pt"
    reference = tmp_path / "reference.pt"
    run = subprocess.run([sys.executable, str(script), daemon.endpoint, str(path), str(reference), mode],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if mode == "commit":
        assert datastates.latest(daemon.root) == "global_step42"
    else:
        assert daemon.ctl("wait", "--timeout", "60").returncode == 0
        assert datastates.latest(daemon.root) is None, "nobody committed the tag"
    assert_state_equal(torch.load(reference), load_both(path))


@pytest.mark.parametrize("cpu_capture", ["auto", "shm"])
def test_snapshots_leave_tensors_in_place(daemon: DaemonProc, cpu_capture: str) -> None:
    """No snapshot moves a storage, read in place (the default) or copied through /dev/shm.

    Either way every snapshot holds the values of its step, and the trainer keeps using its tensors.
    """
    model, opt = trained(steps=1)
    weight = model.blocks[0].fc.weight
    before = weight.detach().clone()
    ptrs = [weight.untyped_storage().data_ptr()]
    with Client(daemon.endpoint, timeout=60, cpu_capture=cpu_capture) as client:
        assert client.in_place == (cpu_capture == "auto"), "this machine lets the daemon read the trainer in place"
        for step in (1, 2, 3):
            path = daemon.root / f"global_step{step}" / "model_states.pt"
            client.snapshot({"module": model.state_dict()}, path)
            ptrs.append(weight.untyped_storage().data_ptr())
            assert not weight.is_shared()
            client.wait()
            if step == 1:
                assert torch.equal(weight, before), "the snapshot kept the values"
            client.commit(f"global_step{step}").result(timeout=120)
            loaded = load_both(path)
            assert_tensor_bitwise(weight.detach(), loaded["module"]["blocks.0.fc.weight"], f"step {step}")
            train_step(model, opt, step)  # the trainer keeps using its storage

    assert len(set(ptrs)) == 1, "a snapshot moved a storage"


def test_close_before_wait_still_flushes(daemon: DaemonProc) -> None:
    """A trainer that closes (or finishes) right after snapshot() still gets its file: the daemon keeps what it took."""
    model, opt = trained(steps=1)
    state = {"module": model.state_dict(), "optimizer": opt.state_dict()}
    expected = clone_state(state)
    path = daemon.root / "global_step1" / "mp_rank_00_model_states.pt"
    c = datastates.Client(daemon.endpoint, timeout=60)
    c.snapshot(state, path)
    c.close()
    del state, model, opt  # the trainer's memory may go away; the daemon's mapping of it stays

    assert daemon.ctl("wait", "--timeout", "60").returncode == 0
    assert_state_equal(expected, load_both(path))
