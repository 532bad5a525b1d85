#!/bin/bash
# The long fault-schedule run: CHUNKS chunks of SIZE schedules from FIRST_SEED on,
# each chunk one pytest run of tests/faults/test_schedules.py (root and a loop mount needed for
# the disk faults). Run two at once on disjoint seeds to use two cores, e.g.:
#   bash bench/fault_schedules.sh 10000 20 50 /tmp/a.sum & bash bench/fault_schedules.sh 20000 20 50 /tmp/b.sum
# Each chunk appends its tally (schedules, faults by kind, what the trainer was told) to SUMMARY,
# and on a violation its seed, message and shortest schedule. Replay one schedule with
#   DATASTATES_SEED=<seed> DATASTATES_SCHEDULES=1 .venv/bin/python -m pytest -s tests/faults/test_schedules.py
set -u
cd "$(dirname "$0")/.."
first=$1 chunks=$2 size=$3 summary=$4
for ((i = 0; i < chunks; i++)); do
    seed=$((first + i * size))
    log=/tmp/fault-schedules-$seed.out
    DATASTATES_SEED=$seed DATASTATES_SCHEDULES=$size .venv/bin/python -m pytest -q -s -p no:cacheprovider \
        tests/faults/test_schedules.py --basetemp=/tmp/fault-schedules-$seed >"$log" 2>&1
    rc=$?
    echo "seed $seed rc $rc: $(grep -h '^[0-9]* schedules,' "$log")" >>"$summary"
    [ $rc -eq 0 ] || grep -v "gave no sign" "$log" | grep "^E " | head -20 >>"$summary"
done
