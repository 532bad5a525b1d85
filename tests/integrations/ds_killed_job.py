"""A DeepSpeed job with only ``datastates_ckpt`` in its config, killed with SIGKILL between two saves.

Usage: ds_killed_job.py ENDPOINT SAVE_DIR EXPECTED. Trains two steps, saves (global_step2),
writes the state it saved to EXPECTED with torch.save, steps once (which commits
global_step2), saves again (global_step3) and kills itself before anything commits it.
"""

import os
import signal
import socket
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' conftest, which test_deepspeed imports

import deepspeed  # noqa: E402
import torch  # noqa: E402

from test_deepspeed import ds_initialize, snapshot_of, train_step  # noqa: E402

endpoint, save_dir, expected = sys.argv[1:4]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update({"DATASTATES_ENDPOINT": endpoint, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                   "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the tests' ds_dist fixture
deepspeed.init_distributed(dist_backend="gloo")
engine = ds_initialize(seed=0, datastates_ckpt={})
for step in range(2):
    train_step(engine, seed=step)
torch.save(snapshot_of(engine), expected)
engine.save_checkpoint(save_dir)
train_step(engine, seed=2)
engine.save_checkpoint(save_dir)
os.kill(os.getpid(), signal.SIGKILL)
