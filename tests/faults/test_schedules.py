"""I1-I5 under seeded fault schedules: stalls, kills, a full or read-only disk, re-saves, clock steps.

``DATASTATES_SCHEDULES`` sets how many schedules run (6 by default, which keeps ``make test``
within 15 minutes, and 200 with ``--long``; .ci/run sets 200; the closing figures come from 2,000 or more, run as
``bench/fault_schedules.sh`` in chunks on two cores), ``DATASTATES_SEED`` the first seed, so a
failure printed with its seed replays with ``DATASTATES_SEED=<seed> DATASTATES_SCHEDULES=1``.
See tests/faults/schedules.py for what a schedule does and what is checked after it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from schedules import Node, Schedule, Violation, shortest

SCHEDULES_SET = os.environ.get("DATASTATES_SCHEDULES", "")
LONG_SCHEDULES = 200
"""With ``--long`` (and in CI, through ``DATASTATES_SCHEDULES``); a plain ``make test`` runs SHORT_SCHEDULES."""
SHORT_SCHEDULES = 6
FIRST_SEED = int(os.environ.get("DATASTATES_SEED", "1"))


@pytest.mark.timeout(120 + 20 * int(SCHEDULES_SET or LONG_SCHEDULES))  # about 3 s a schedule; the suite's is 300 s
def test_every_fault_schedule_keeps_committed_tags_whole_and_ordered(tmp_path: Path, long_runs: bool) -> None:
    schedules = int(SCHEDULES_SET) if SCHEDULES_SET else LONG_SCHEDULES if long_runs else SHORT_SCHEDULES
    node = Node(tmp_path)
    failure = ""
    started = time.monotonic()
    try:
        for seed in range(FIRST_SEED, FIRST_SEED + schedules):
            schedule = Schedule.draw(seed, node.faults)
            try:
                node.run(schedule)
            except Violation as exc:
                failure = f"{exc}\n{schedule}\nshortest schedule that shows it:\n{shortest(node, schedule)}"
                break
    finally:
        node.close()
    print(f"\n{node.tally}; {time.monotonic() - started:.0f} s")
    skipped = sorted(set(("disk_full", "read_only")) - set(node.faults))
    if skipped:
        print(f"not injected here (they need root and a loop mount): {skipped}")
    assert not failure, failure
