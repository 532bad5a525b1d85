"""The GPU tests: marked ``gpu`` and skipped, with the reason, wherever no CUDA device is present.

CI collects tests/ on CPU-only machines, so nothing here may need CUDA to import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

HERE = Path(__file__).parent
NO_CUDA = "needs a CUDA device (none here); the GPU path has not run on this machine"

CHILD = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
out = getattr(importlib.import_module(sys.argv[2]), sys.argv[3])(*sys.argv[4:])
if out is not None:
    print(json.dumps(out))
"""
"""A child's program: import the test module from tests/, call one of its functions, print its result as JSON."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of this folder ``gpu``, and skip them all without a CUDA device."""
    skip = None if torch.cuda.is_available() else pytest.mark.skip(reason=NO_CUDA)
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture
def start_child() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start ``fn(*args)`` of a test module as a trainer of its own (CUDA IPC cannot open a block in the process
    that made it); whatever still runs at teardown is killed, so no test leaves a trainer holding the GPU."""
    started: list[subprocess.Popen] = []

    def start(fn: Callable[..., Any], *args: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", CHILD, str(HERE.parent), fn.__module__, fn.__name__, *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def run_child(start_child: Callable[..., subprocess.Popen]) -> Callable[..., Any]:
    """Run ``fn(*args)`` as a trainer of its own until it exits 0 within ``timeout``; what it returned (JSON)."""

    def run(fn: Callable[..., Any], *args: str, timeout: float = 300) -> Any:
        proc = start_child(fn, *args)
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{fn.__name__} failed ({proc.returncode}):\n{err}"
        return json.loads(out.strip().splitlines()[-1]) if out.strip() else None

    return run
