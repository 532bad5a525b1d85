"""The GPU tests: marked ``gpu`` and skipped, with the reason, wherever no CUDA device is present.

CI collects tests/ on CPU-only machines, so nothing here may need CUDA to import.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "needs a CUDA device (none here); the GPU path has not run on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``gpu``, and skip them all without a CUDA device."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture
def run_child() -> Callable[..., str]:
    """Run a Python script in a fresh process (CUDA IPC refuses a block opened by its own process); its stdout."""

    def run(script: str, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr}"
        return proc.stdout.strip()

    return run
