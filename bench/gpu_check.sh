#!/usr/bin/env bash
# The GPU device check of issue 6, as one script: run it on a machine with a CUDA device
# and a CUDA build of torch already installed (it installs datastates itself, without deps).
# Prints the GPU tests' outcome and bench/gpu.py's ratios; writes both logs to $OUT if set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
python3 -m pytest -q -ra -p no:cacheprovider tests/gpu tests/test_cuda_handles.py 2>&1 | tee "$out/gpu_tests.log"
rc=${PIPESTATUS[0]}
python3 bench/gpu.py --runs 3 2>&1 | tee "$out/gpu_bench.log"
exit $(( rc || PIPESTATUS[0] ))
