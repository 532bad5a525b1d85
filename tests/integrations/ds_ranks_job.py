"""Two ranks under torchrun, ZeRO stage 2, with only ``datastates_ckpt`` in the DeepSpeed config.

Usage: torchrun --standalone --nproc-per-node 2 ds_ranks_job.py train|resume SAVE_DIR EXPECTED_DIR.
``train``: two steps, save (global_step2), one step (its pre-step hook commits global_step2
on every rank), save (global_step3), ``destroy()``; each rank writes the state it saved
at each tag to EXPECTED_DIR with torch.save. ``resume``: a fresh engine loads each tag
and every rank checks its own partition bitwise against what it saved.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' conftest, which test_deepspeed imports

import deepspeed  # noqa: E402
import torch  # noqa: E402

from conftest import assert_state_equal  # noqa: E402
from test_deepspeed import ds_initialize, snapshot_of, train_step  # noqa: E402

mode, save_dir, expected = sys.argv[1], sys.argv[2], Path(sys.argv[3])
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the tests' ds_dist fixture
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
config = {"train_batch_size": 2, "datastates_ckpt": {}}
if mode == "train":
    engine = ds_initialize(seed=0, stage=2, **config)
    for step in range(3):
        train_step(engine, seed=10 * rank + step)
        if step >= 1:
            torch.save(snapshot_of(engine), expected / f"global_step{step + 1}-rank{rank}.pt")
            engine.save_checkpoint(save_dir)
    engine.destroy()
else:
    engine = ds_initialize(seed=1, stage=2, **config)
    for tag in ("global_step3", "global_step2"):
        engine.load_checkpoint(save_dir, tag=None if tag == "global_step3" else tag)  # None: DeepSpeed's 'latest'
        assert engine.global_steps == int(tag.removeprefix("global_step"))
        assert_state_equal(torch.load(expected / f"{tag}-rank{rank}.pt"), snapshot_of(engine), f"rank {rank} {tag}")
    engine.destroy()
print(f"rank {rank}: {mode} ok", flush=True)
