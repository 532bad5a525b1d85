"""A /dev/shm too small for the state (Docker's default is 64 MB).

The test runs a private mount namespace (``unshare -m``) whose /dev/shm is a 64 MiB tmpfs,
and inside it a real daemon and real trainer processes, one per case. Read in place (the
default), /dev/shm plays no part: a state twice its size round-trips. Through shared memory
(``cpu_capture="shm"``) what must hold:

- a state that fits round-trips bitwise through the daemon;
- a storage that does not fit raises SharedMemoryError at ``snapshot()``, whose message
  names /dev/shm, the storage's size and the fix (``--shm-size``): never a SIGBUS, also
  when an earlier storage of the same state already took the room, and also at the very
  edge (a storage of exactly the free bytes, which its segment's prefix makes too large);
- the refused storage leaves /dev/shm as it was, and the same client and the daemon
  go on serving.

This file is also the program run inside the namespace (``driver``): it starts the daemon,
forks one trainer process per case and writes what each saw, and how it ended, to
``results.json``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any, Iterator

import pytest

MiB = 1 << 20
SHM_SIZE = "64m"
CASES = ("in_place", "fits", "too_big", "second_does_not_fit", "exact_free", "largest_that_fits")
TOO_BIG = 128 * MiB
HALF = 40 * MiB
CASE_HANG_GUARD = 120


# -- inside the namespace ------------------------------------------------------------------


def shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def fitting_state() -> dict[str, Any]:
    """16 MiB of random tensors and a few Python objects, the same in every process."""
    import torch

    g = torch.Generator().manual_seed(16)
    return {"w": torch.randn(4 * MiB, generator=g), "b": torch.randn(1000, generator=g).half(), "step": 16}


def run_client(case: str, endpoint: str, root: Path) -> dict[str, Any]:
    """One trainer: the case's snapshot, then (after a refusal) a small one that must still commit."""
    import torch

    from datastates.client import Client
    from datastates.protocol.errors import DatastatesError

    out: dict[str, Any] = {"case": case, "free_before": shm_free()}
    with Client(endpoint, timeout=30, cpu_capture="auto" if case == "in_place" else "shm") as c:
        if case == "in_place":
            out["in_place"] = c.in_place
            c.snapshot({"w": torch.full((TOO_BIG,), 5, dtype=torch.uint8)}, root / case / "model_states.pt")
            c.wait()
            out["committed"] = c.commit(case).result(timeout=60).tag
            out["free_after"] = shm_free()
            return out
        if case == "fits":
            c.snapshot(fitting_state(), root / case / "model_states.pt")
            c.wait()
            out["committed"] = c.commit(case).result(timeout=60).tag
            return out
        if case == "largest_that_fits":
            out["nbytes"] = n = out["free_before"] - 64  # torch's 64-byte refcount prefix fills the last block
            c.snapshot({"w": torch.full((n,), 7, dtype=torch.uint8)}, root / case / "model_states.pt")
            c.wait()
            out["committed"] = c.commit(case).result(timeout=60).tag
            return out
        state = {
            "too_big": lambda: {"w": torch.zeros(TOO_BIG // 4)},
            "second_does_not_fit": lambda: {"a": torch.zeros(HALF // 4), "b": torch.zeros(HALF // 4)},
            "exact_free": lambda: {"w": torch.zeros(out["free_before"], dtype=torch.uint8)},
        }[case]()
        try:
            c.snapshot(state, root / case / "model_states.pt")
        except DatastatesError as exc:
            out["error"] = {"type": type(exc).__name__, "message": exc.message}
        out["free_after"] = shm_free()
        c.snapshot({"w": torch.ones(1024)}, root / f"{case}_after" / "model_states.pt")
        c.wait()
        out["after_committed"] = c.commit(f"{case}_after").result(timeout=60).tag
    return out


def run_case(case: str, endpoint: str, root: Path) -> dict[str, Any]:
    """``run_client`` in a forked trainer process of its own; how that process ended, and what it saw."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the trainer: torch is imported already, so a case costs no start-up
        os.close(r)
        signal.alarm(CASE_HANG_GUARD)  # a hung case dies with SIGALRM and is reported, instead of hanging the suite
        code = 0
        try:
            out = run_client(case, endpoint, root)
        except BaseException:
            out, code = {"traceback": traceback.format_exc()}, 1
        with os.fdopen(w, "w") as f:
            f.write(json.dumps(out))
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        seen = f.read()
    _, status = os.waitpid(pid, 0)
    return {"case": case, "returncode": os.waitstatus_to_exitcode(status), **(json.loads(seen) if seen else {})}


def run_driver(workdir: Path) -> None:
    """The daemon for all cases, and one trainer process per case; what they saw goes to results.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from conftest import DaemonFactory

    import torch  # noqa: F401  (once, before the trainers fork)

    factory = DaemonFactory(workdir)
    d = factory.start()
    (workdir / "daemon.pid").write_text(str(d.proc.pid))
    st = os.statvfs("/dev/shm")
    results: dict[str, Any] = {"shm_total": st.f_blocks * st.f_frsize}
    try:
        for case in CASES:
            results[case] = run_case(case, d.endpoint, d.root)
        results["daemon_alive"] = d.proc.poll() is None
    finally:
        factory.stop_all()
        results["daemon_returncode"] = d.proc.returncode
        results["daemon_log"] = d.log_text()[-20000:]
        (workdir / "results.json").write_text(json.dumps(results))


# -- the tests, outside ----------------------------------------------------------------------


def namespace_prefix() -> list[str]:
    """How to get a private mount namespace here whose /dev/shm we may mount over; skips if none."""
    errors = []
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]):
        probe = subprocess.run([*prefix, "sh", "-c", f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0:
            return prefix
        errors.append(f"{' '.join(prefix)}: {probe.stderr.strip()}")
    pytest.skip("no private mount namespace with a small /dev/shm here: " + "; ".join(errors))


def kill_leftover_daemon(workdir: Path) -> None:
    """If the driver died before stopping its daemon, stop it (it runs in our PID namespace)."""
    pidfile = workdir / "daemon.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"datastatesd" in cmdline:
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def small_shm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every case run once inside one namespace with a 64 MiB /dev/shm: (the daemon's root, results)."""
    prefix = namespace_prefix()
    workdir = tmp_path_factory.mktemp("small_shm")
    script = f'mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && exec "$0" "$@"'
    try:
        driver = subprocess.run([*prefix, "sh", "-c", script, sys.executable, __file__, "driver", str(workdir)],
                                capture_output=True, text=True, timeout=300)
    finally:
        kill_leftover_daemon(workdir)
    assert driver.returncode == 0, driver.stdout + driver.stderr
    yield workdir / "ckpt", json.loads((workdir / "results.json").read_text())


def ran(results: dict[str, Any], case: str) -> dict[str, Any]:
    """The case's result; the trainer must have exited normally (a SIGBUS shows as -7)."""
    res = results[case]
    assert res["returncode"] != -signal.SIGBUS, f"{case}: the trainer was killed by SIGBUS"
    assert res["returncode"] == 0, f"{case}: the trainer exited with {res['returncode']}:\n{res.get('traceback')}"
    return res


def assert_refused(res: dict[str, Any], nbytes: int) -> None:
    """A SharedMemoryError at snapshot() naming /dev/shm, the size and the fix; /dev/shm as before; client alive."""
    assert res.get("error"), f"{res['case']}: snapshot() raised nothing"
    assert res["error"]["type"] == "SharedMemoryError", res["error"]
    msg = res["error"]["message"]
    assert "/dev/shm" in msg and str(nbytes) in msg and "--shm-size" in msg, msg
    assert res["after_committed"] == f"{res['case']}_after"


def test_a_state_that_fits_round_trips(small_shm: tuple[Path, dict[str, Any]]) -> None:
    import datastates

    from conftest import assert_state_equal

    root, results = small_shm
    res = ran(results, "fits")
    assert res["committed"] == "fits"
    assert_state_equal(fitting_state(), datastates.load(root / "fits" / "model_states.pt"))


def test_read_in_place_a_state_larger_than_dev_shm_round_trips(small_shm: tuple[Path, dict[str, Any]]) -> None:
    """128 MiB with a 64 MiB /dev/shm, read in place: committed bitwise, and /dev/shm left as it was."""
    import torch

    import datastates

    root, results = small_shm
    res = ran(results, "in_place")
    assert res["in_place"] and res["committed"] == "in_place"
    assert res["free_after"] == res["free_before"]
    loaded = datastates.load(root / "in_place" / "model_states.pt")
    assert torch.equal(loaded["w"], torch.full((TOO_BIG,), 5, dtype=torch.uint8))


def test_a_storage_larger_than_dev_shm_is_refused(small_shm: tuple[Path, dict[str, Any]]) -> None:
    """128 MiB into a 64 MiB /dev/shm: refused before any byte moves."""
    _root, results = small_shm
    res = ran(results, "too_big")
    assert_refused(res, TOO_BIG)
    assert res["free_after"] == res["free_before"]


def test_a_storage_that_no_longer_fits_after_the_first_is_refused(small_shm: tuple[Path, dict[str, Any]]) -> None:
    """Two 40 MiB tensors: the first fits and moves, the second finds 24 MiB left and is refused, not a SIGBUS."""
    _root, results = small_shm
    res = ran(results, "second_does_not_fit")
    assert_refused(res, HALF)
    assert res["free_before"] - res["free_after"] >= HALF  # the first one did move: the check saw what was left


def test_a_storage_of_exactly_the_free_space_is_refused(small_shm: tuple[Path, dict[str, Any]]) -> None:
    """The segment holds torch's prefix too: a storage of exactly the free bytes does not fit, and says so."""
    _root, results = small_shm
    res = ran(results, "exact_free")
    assert_refused(res, res["free_before"])
    assert res["free_after"] == res["free_before"]


def test_the_largest_storage_that_fits_is_taken(small_shm: tuple[Path, dict[str, Any]]) -> None:
    """The check is exact, not merely cautious: a storage filling /dev/shm to the last block round-trips."""
    import torch

    import datastates

    root, results = small_shm
    res = ran(results, "largest_that_fits")
    assert res["committed"] == "largest_that_fits"
    assert res["nbytes"] > results["shm_total"] - 4 * MiB  # nearly all of /dev/shm: the other cases left nothing behind
    loaded = datastates.load(root / "largest_that_fits" / "model_states.pt")
    assert torch.equal(loaded["w"], torch.full((res["nbytes"],), 7, dtype=torch.uint8))


def test_the_daemon_serves_on_and_drains(small_shm: tuple[Path, dict[str, Any]]) -> None:
    _root, results = small_shm
    assert results["daemon_alive"], results["daemon_log"]
    assert results["daemon_returncode"] == 0, results["daemon_log"]
    assert "Traceback" not in results["daemon_log"]


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "driver":
        run_driver(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown role {role!r}")
