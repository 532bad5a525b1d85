#!/usr/bin/env bash
# The GPU device check of issue 6, as one script: run it on a machine with a CUDA device
# and a CUDA build of torch already installed (it installs datastates itself, without deps).
# Each part has a time limit, so the whole fits a short lease (about 150 s on an H200).
# Prints the GPU tests' outcome and bench/gpu.py's ratios; writes both logs to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
timeout 300 python3 -m pytest --timeout=120 -q -ra -p no:cacheprovider tests/gpu tests/test_cuda_handles.py 2>&1 | tee "$out/gpu_tests.log"
rc=${PIPESTATUS[0]}
timeout 240 python3 bench/gpu.py --runs 3 --steps 40 2>&1 | tee "$out/gpu_bench.log"
exit $(( rc || PIPESTATUS[0] ))
