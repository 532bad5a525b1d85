#!/usr/bin/env bash
# The GPU device check of issue 15, as one script: run it on a machine with a CUDA device
# and a CUDA build of torch already installed (it installs datastates itself, without deps).
# In order, each step under its own time limit (its whole process group: daemons and
# trainers too), all within 10 minutes on one H200: the environment; tests/gpu (and
# tests/test_cuda_handles.py) without the killed-trainer test; the 1,200-share probe;
# bench/gpu.py --runs 1; restores into CUDA tensors (bench/restore.py --device cuda: in place
# from the replica and from storage, against torch.load and DCP onto the GPU); the
# killed-trainer test alone under 90 s. Each step's log goes to
# $OUT (default /tmp); $OUT/gpu_summary.txt gets each step's exit code and duration, then
# the key figures. Exits non-zero if any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
summary=$out/gpu_summary.txt
killed=tests/gpu/test_gpu_path.py::test_a_trainer_killed_before_its_gpu_copy_never_commits_bytes_from_before_its_snapshot
export PYTHONUNBUFFERED=1
mkdir -p "$out"
: > "$summary"
failed=0

# step NAME LIMIT CMD...: CMD under `timeout LIMIT`, logged to $out/NAME.log; its exit code and duration to the summary.
step() {
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    echo "== $name (limit $limit s)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    rc=${PIPESTATUS[0]}
    printf '%-8s rc %-3s %4s s of %s s%s\n' "$name" "$rc" $((SECONDS - start)) "$limit" \
        "$([ "$rc" = 124 ] && echo ' (timed out)')" >> "$summary"
    [ "$rc" = 0 ] || failed=1
    return "$rc"
}

# figures: the lines of each log worth keeping in the summary.
figures() {
    local counts='^(FAILED|ERROR)|[0-9]+ (passed|failed|errors?|skipped)'
    echo; echo "== environment"; cat "$out/env.log"
    echo "== tests/gpu"; grep -E "$counts" "$out/tests.log" | tail -n 12
    echo "== 1,200-share probe"; grep -E '^probe:|^ *(tag|p[0-9]+) ' "$out/probe.log"
    echo "== bench/gpu.py --runs 1"; sed -n '/^daemon:/p;/^medians of/,$p' "$out/bench.log"
    echo "== bench/restore.py --device cuda"; sed -n '/^medians of/,$p' "$out/restore.log"
    echo "== killed trainer"; grep -E "$counts" "$out/killed.log" | tail -n 3
}

finish() {
    echo "total    $SECONDS s" >> "$summary"
    figures >> "$summary" 2>/dev/null
    echo; cat "$summary"
    exit "$failed"
}

step install 40 python3 -m pip install -q --no-deps --no-build-isolation -e . || finish
step env 20 python3 - <<'EOF' || finish
import ctypes, os, shutil, subprocess, torch
assert torch.cuda.is_available(), "no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
cuda, version, device, mode = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
cuda.cuInit(0)
cuda.cuDriverGetVersion(ctypes.byref(version))
cuda.cuDeviceGet(ctypes.byref(device), 0)
cuda.cuDeviceGetAttribute(ctypes.byref(mode), 20, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_MODE
modes = {0: "default", 1: "exclusive-thread", 2: "prohibited", 3: "exclusive-process"}
print(f"driver CUDA API {version.value // 1000}.{version.value % 1000 // 10}, compute mode {modes.get(mode.value, mode.value)}")
yama = "/proc/sys/kernel/yama/ptrace_scope"
print(f"ptrace_scope {open(yama).read().strip() if os.path.exists(yama) else 'absent (no Yama)'}, "
      f"PYTORCH_CUDA_ALLOC_CONF {os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
if shutil.which("nvidia-smi"):
    subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,compute_mode,clocks.max.sm,memory.total",
                    "--format=csv"], timeout=15)
else:
    print("nvidia-smi: absent")
EOF
step tests 190 python3 -m pytest -x -q -ra -p no:cacheprovider tests/gpu tests/test_cuda_handles.py --deselect "$killed"
step probe 70 python3 bench/gpu_share_probe.py --snapshots 1200
step bench 70 python3 bench/gpu.py --runs 1
step restore 120 python3 bench/restore.py --device cuda --layers 3 --runs 3
step killed 90 python3 -m pytest -q -ra -p no:cacheprovider "$killed"
finish
