"""Retention and the tag tools: keep_last in the daemon, and ``datastatesctl ls``, ``prune`` and ``convert``.

A tag goes only once newer ones are committed beside it, never an uncommitted folder and
never the newest committed one; converted files load in plain torch and safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file

import datastates
from datastates.client import Client
from datastates.protocol.format import TRACKER
from datastates.protocol.tags import committed_tags

from conftest import DaemonProc, assert_state_equal, save


@pytest.fixture
def daemon(shared_daemon_folder: DaemonProc) -> DaemonProc:
    """One daemon for the module, a storage folder per test (``own_daemon`` tests get their own daemon)."""
    return shared_daemon_folder


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16)},
            "optim": {"step": step, "lr": 0.1, "betas": (0.9, 0.99)}, "name": f"run-{step}", "extra": None}


def checkpoint(d: DaemonProc, steps: range, commit: bool = True) -> None:
    with Client(d.endpoint, timeout=60) as c:
        for step in steps:
            if commit:
                save(c, state(step), d.root / f"step{step}" / "rank0.pt")
            else:
                c.snapshot(state(step), d.root / f"step{step}" / "rank0.pt")
                c.wait()


def tags(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_keep_last_keeps_the_newest_committed_and_every_uncommitted(
        start_daemon: Callable[..., DaemonProc], tmp_path: Path) -> None:
    d = start_daemon(storage={"roots": [str(tmp_path / "ckpt")], "keep_last": 2})
    checkpoint(d, range(1, 3), commit=False)  # two saves never committed: a crash left them
    checkpoint(d, range(3, 7))
    assert tags(d.root) == ["step1", "step2", "step5", "step6"]
    assert datastates.latest(d.root) == "step6"
    assert_state_equal(state(5), datastates.load(d.root / "step5" / "rank0.pt"))


def test_ls_shows_state_size_and_the_daemons_memory_copy(start_daemon: Callable[..., DaemonProc]) -> None:
    d = start_daemon()
    checkpoint(d, range(1, 3))
    checkpoint(d, range(3, 4), commit=False)
    out = d.ctl("ls", str(d.root))
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert rows["step2"][1] == "committed" and "storage+memory" in rows["step2"]  # the newest committed: in memory
    assert rows["step1"][1] == "committed" and "storage" in rows["step1"] and "storage+memory" not in rows["step1"]
    assert rows["step3"][1] == "uncommitted"
    assert out.stdout.splitlines()[1].split()[0] == "step3"  # newest first
    size = (d.root / "step2" / "rank0.pt").stat().st_size + (d.root / "step2" / "datastates-commit.step2.json").stat().st_size
    assert f"{size / 1024:.1f} KiB" in " ".join(rows["step2"])


def test_prune_deletes_only_older_committed_tags(daemon: DaemonProc) -> None:
    d = daemon
    checkpoint(d, range(1, 4))
    checkpoint(d, range(4, 5), commit=False)
    dry = d.ctl("prune", str(d.root), "--keep-last", "1", "--dry-run")
    assert dry.returncode == 0 and "would delete" in dry.stdout and tags(d.root) == ["step1", "step2", "step3", "step4"]
    out = d.ctl("prune", str(d.root), "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    assert tags(d.root) == ["step3", "step4"]  # step4 was never committed: not a candidate
    assert datastates.latest(d.root) == "step3"
    bad = d.ctl("prune", str(d.root), "--keep-last", "0")
    assert bad.returncode == 2 and "newest committed tag always stays" in bad.stderr
    assert tags(d.root) == ["step3", "step4"]


def test_convert_to_torch_and_safetensors(daemon: DaemonProc, tmp_path: Path) -> None:
    d = daemon
    checkpoint(d, range(1, 2))
    out = d.ctl("convert", str(d.root / "step1"), "--to", "torch", "--out", str(tmp_path / "pt"))
    assert out.returncode == 0, out.stderr
    assert_state_equal(state(1), torch.load(tmp_path / "pt" / "rank0.pt", weights_only=True))

    out = d.ctl("convert", str(d.root / "step1"), "--to", "safetensors", "--out", str(tmp_path / "st"))
    assert out.returncode == 0, out.stderr
    tensors = load_file(tmp_path / "st" / "rank0.safetensors")
    expected = state(1)
    assert torch.equal(tensors["model.w"], expected["model"]["w"]) and torch.equal(tensors["model.b"], expected["model"]["b"])
    tree = json.loads((tmp_path / "st" / "rank0.json").read_text())
    assert tree["model"] == {"w": {"__tensor__": "model.w"}, "b": {"__tensor__": "model.b"}}
    assert tree["optim"] == {"step": 1, "lr": 0.1, "betas": [0.9, 0.99]} and tree["name"] == "run-1" and tree["extra"] is None


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_convert_refuses_an_uncommitted_tag(daemon: DaemonProc, tmp_path: Path, to: str) -> None:
    d = daemon
    checkpoint(d, range(1, 2), commit=False)
    out = d.ctl("convert", str(d.root / "step1"), "--to", to, "--out", str(tmp_path / "x"))
    assert out.returncode == 2 and "no committed tag 'step1'" in out.stderr
    assert not (tmp_path / "x").exists()


def test_convert_writes_only_inside_out_and_loads_safely_unless_told(daemon: DaemonProc, tmp_path: Path) -> None:
    """A marker entry that climbs out of the tag's folder is refused before anything is written; a file holding an
    arbitrary object is refused by the safe default where converting unpickles it, and converted with
    --no-weights-only."""
    import fractions

    d = daemon
    checkpoint(d, range(1, 2))
    folder = d.root / "step1"
    marker_path = folder / "datastates-commit.step1.json"
    marker = json.loads(marker_path.read_text())
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = outside / "rank0.pt"
    evil.write_bytes((folder / "rank0.pt").read_bytes())  # so the marker's sizes still hold
    crafted = tmp_path / "crafted" / "step1"
    crafted.mkdir(parents=True)
    for entry in marker["files"]:  # up to / from the crafted tag's folder, then down to the file outside
        entry["path"] = "../" * (len(crafted.parts) - 1) + str(evil).lstrip("/")
    (crafted / marker_path.name).write_text(json.dumps(marker))
    out = d.ctl("convert", str(crafted), "--to", "torch", "--out", str(tmp_path / "o"))
    assert out.returncode != 0 and "not a file inside" in out.stderr, out.stderr
    assert not (tmp_path / "o").exists() and sorted(p.name for p in outside.iterdir()) == ["rank0.pt"]

    risky = {"w": torch.ones(3), "ratio": fractions.Fraction(1, 3)}
    with Client(d.endpoint, timeout=60) as c:
        save(c, risky, d.root / "risky" / "rank0.pt")
    out = d.ctl("convert", str(d.root / "risky"), "--to", "safetensors", "--out", str(tmp_path / "r"))
    assert out.returncode != 0 and "safe loader" in out.stderr, out.stderr
    out = d.ctl("convert", str(d.root / "risky"), "--to", "safetensors", "--out", str(tmp_path / "r"), "--no-weights-only")
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "r" / "rank0.json").read_text())["ratio"]["__repr__"] == "Fraction(1, 3)"
    # to torch, a format-2 file is checked and copied: nothing in it is unpickled, so nothing needs allowing
    out = d.ctl("convert", str(d.root / "risky"), "--to", "torch", "--out", str(tmp_path / "t"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "t" / "rank0.pt").read_bytes() == (d.root / "risky" / "rank0.pt").read_bytes()
    assert torch.load(tmp_path / "t" / "rank0.pt", weights_only=False)["ratio"] == risky["ratio"]


def test_prune_of_a_tag_withdraws_its_older_marker_in_another_tags_folder(daemon: DaemonProc) -> None:
    """Tag t0 saved once into t1's folder, then into its own: readers take its newest marker. Pruning t0 must
    take both, or t0 stands again holding the older step, which the trainer was never told is its newest
    (the fault schedules, seed 190143)."""
    d = daemon
    with Client(d.endpoint, timeout=60) as c:
        save(c, state(1), d.root / "t1" / "rank0.pt", tag="t0")
        save(c, state(2), d.root / "t0" / "rank0.pt", tag="t0")
        save(c, state(3), d.root / "t2" / "rank0.pt", tag="t2")
    assert_state_equal(state(2), datastates.load(d.root / "t0" / "rank0.pt"))
    out = d.ctl("prune", str(d.root), "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    standing = {t.tag for t in committed_tags(str(d.root))}
    assert standing == {"t2"}, f"tags still committed after the prune: {standing}"
    assert datastates.latest(d.root) == "t2"


def test_prune_keeps_the_tag_the_tracker_names(daemon: DaemonProc) -> None:
    """A tracker left naming an older tag (the daemon killed between a marker and its tracker) keeps that tag from
    a prune: deleting it would leave DeepSpeed's ``latest`` naming nothing (seed 190183)."""
    d = daemon
    checkpoint(d, range(1, 4))
    (d.root / TRACKER).write_text("step2")
    out = d.ctl("prune", str(d.root), "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    assert tags(d.root) == ["step2", "step3"]
    assert (d.root / TRACKER).read_text() == "step2"
    assert "tracker beside it names it" in out.stderr + out.stdout


def test_a_local_commit_moves_the_tracker_on(tmp_path: Path) -> None:
    """A trainer saving on its own (``fallback="local"``, no daemon) names each tag it commits in the tracker, as
    the daemon does: else the tracker names an older tag than the run's newest."""
    root = tmp_path / "ckpt"
    with Client(f"ipc://{tmp_path}/no-daemon.sock", timeout=2, fallback="local") as local:
        for step in (1, 2):
            save(local, state(step), root / f"step{step}" / "rank0.pt")
            assert (root / TRACKER).read_text() == f"step{step}"
    assert datastates.latest(root) == "step2"
