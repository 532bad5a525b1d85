"""A DeepSpeed job with only ``datastates_ckpt`` in its config, killed with SIGKILL between two saves.

Usage: ds_killed_job.py ENDPOINT SAVE_DIR EXPECTED. Trains two steps, saves (global_step2),
writes the state it saved to EXPECTED with torch.save, steps once (which commits
global_step2), saves again (global_step3) and kills itself before anything commits it.
"""

import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' conftest, which test_deepspeed imports

import torch  # noqa: E402

from test_deepspeed import one_rank_job, snapshot_of, train_step  # noqa: E402

endpoint, save_dir, expected = sys.argv[1:4]
engine = one_rank_job(endpoint)
for step in range(2):
    train_step(engine, seed=step)
torch.save(snapshot_of(engine), expected)
engine.save_checkpoint(save_dir)
train_step(engine, seed=2)
engine.save_checkpoint(save_dir)
os.kill(os.getpid(), signal.SIGKILL)
