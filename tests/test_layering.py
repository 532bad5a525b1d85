"""The trainer side stands alone: loading a checkpoint pulls in no daemon, and the layers point one way.

``import datastates`` promises a light import for ``load()`` users (a restore script, an
evaluation job, a converter): no zmq, no yaml, no daemon module. The import graph runs
protocol → client and protocol → daemon, with no cycle; the one client → daemon edge is
the opt-in local fallback, imported only when it engages.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from conftest import DaemonProc, save

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("zmq", "yaml", "datastates.daemon")


def _loaded_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running ``code``."""
    probe = code + f"\nimport json, sys\nprint(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY[:2]!r}"
    probe += f" or m == {HEAVY[2]!r} or m.startswith({HEAVY[2] + '.'!r}))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_datastates_loads_no_daemon_zmq_or_yaml() -> None:
    assert _loaded_after("import datastates") == []


def test_import_datastates_and_latest_load_no_torch_either() -> None:
    """Job scripts and ``datastatesctl status`` ask for the newest tag in milliseconds, not after torch's import."""
    code = "import sys, datastates\ndatastates.latest('/nonexistent')\nassert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_load_and_latest_of_a_real_checkpoint_load_no_daemon_zmq_or_yaml(
        shared_client, shared_daemon: DaemonProc) -> None:  # noqa: ANN001
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 7}
    path = shared_daemon.root / "light" / "step7" / "m.pt"
    save(shared_client, state, path, tag="step7")
    code = (f"import datastates\nroot = {str(shared_daemon.root / 'light')!r}\n"
            f"tag = datastates.latest(root)\nassert tag == 'step7', tag\n"
            f"state = datastates.load(root + '/' + tag + '/m.pt')\n"
            f"assert state['step'] == 7 and state['w'].sum().item() == {float(state['w'].sum())}\n")
    assert _loaded_after(code) == []


def test_the_client_package_loads_client_lazily() -> None:
    """``import datastates.client`` alone (the package of the reader) does not start on zmq."""
    assert _loaded_after("import datastates.client, datastates.client.reader.restore") == []


def test_layers_point_one_way_and_have_no_cycle() -> None:
    """No client → daemon import but the lazy fallback, no protocol → above, no import cycle."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "layering.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "import cycles: 0" in out.stdout
