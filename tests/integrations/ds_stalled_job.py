"""A DeepSpeed job with only ``datastates_ckpt`` in its config, whose daemon stalls past liveness mid-save.

Usage: ds_stalled_job.py ENDPOINT SAVE_DIR EXPECTED, driven over stdin and stdout by its test.
Trains two steps, saves (global_step2) and steps (which commits it); prints ``stall`` and
waits for a line: the test has stopped the daemon (SIGSTOP). Saves global_step3, whose
snapshots the stopped daemon never copies, and steps: the step's fence meets the silence
past liveness. Prints ``lost`` and waits for a line: the test has resumed the daemon. Then
goes on as a job does: a step, a save (global_step5, whose state goes to EXPECTED with
torch.save), a step that commits it, and ``destroy()``. Prints ``done``.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' conftest, which test_deepspeed imports

import torch  # noqa: E402

from test_deepspeed import one_rank_job, snapshot_of, train_step  # noqa: E402

LIVENESS = 2.0

endpoint, save_dir, expected = sys.argv[1:4]
engine = one_rank_job(endpoint, liveness=LIVENESS)
for step in range(2):
    train_step(engine, seed=step)
engine.save_checkpoint(save_dir)  # global_step2
train_step(engine, seed=2)  # its fence commits global_step2
engine.checkpoint_engine.ckpt_engine.wait(True)  # answered: the daemon is idle when it is stopped
print("stall", flush=True)
sys.stdin.readline()
engine.save_checkpoint(save_dir)  # global_step3: the messages wait in the socket of a stopped daemon
train_step(engine, seed=3)  # its fence hears nothing for LIVENESS s: global_step3 is lost, the step goes on
print("lost", flush=True)
sys.stdin.readline()
train_step(engine, seed=4)
torch.save(snapshot_of(engine), expected)
engine.save_checkpoint(save_dir)  # global_step5: the client connects again
train_step(engine, seed=5)  # commits global_step5
engine.destroy()
print("done", flush=True)
