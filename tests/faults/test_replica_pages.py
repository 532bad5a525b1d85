"""The replica backend's kept mappings of replica files (daemon/replica/backend.py): never a SIGBUS, never a leak.

A replica's pages are filled in place through a shared mapping, which the writer keeps after
the file is finalized, for the next replica that takes the file over. A replica written
through ``write`` instead (a GPU snapshot's, say) may cut the file shorter than that
mapping; a later in-place use of the stale mapping would store past the end of the file,
and the kernel kills the daemon with SIGBUS. Real files in /dev/shm, the real writer, in a
child process, so a SIGBUS shows as its exit.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import os, sys, tempfile
from datastates.daemon.replica.backend import MemoryStorage
w = MemoryStorage(direct_io=False, owner="0123456789abcdef")
folder = tempfile.mkdtemp(dir="/dev/shm", prefix="ds-test-pages-")
big, small = 8 << 20, 1 << 20
try:
    def in_place(name, reuse, size, fill):
        h = w.create(f"{folder}/{name}", name, reuse)
        pages = w.pages(h, size)
        assert pages is not None, "a /dev/shm file's pages are memory"
        pages[:] = bytes([fill]) * size  # a store past the file's end would be a SIGBUS here
        pages.release()
        w.finalize(h)

    in_place("a", "", big, 1)
    h = w.create(f"{folder}/b", "b", f"{folder}/a")  # taken over, rewritten shorter through write()
    w.write(h, 0, memoryview(bytes([2]) * small))
    w.finalize(h)
    assert os.path.getsize(f"{folder}/b") == small
    in_place("c", f"{folder}/b", big, 3)
    with open(f"{folder}/c", "rb") as f:
        assert f.read() == bytes([3]) * big
    os.unlink(f"{folder}/c")
    w.release_removed()
    mapped = [l for l in open("/proc/self/maps") if folder in l]
    assert not mapped, mapped
    print("OK")
finally:
    for name in os.listdir(folder):
        os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
"""


def test_a_replica_rewritten_shorter_is_mapped_again_not_stored_past_its_end() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"exit {out.returncode} (-7: SIGBUS): {out.stderr[-2000:]}"
    assert out.stdout.strip() == "OK"
