"""datastates: a per-node checkpoint daemon for PyTorch training.

The trainer-side API: ``Client``, ``CheckpointManager``, ``load`` and ``latest``, and
``CheckpointEngine`` (DataStates-LLM's API, which DeepSpeed's ``datastates_ckpt`` config
imports). Each loads on first use, so ``import datastates`` is light: no torch until one
is used, and never zmq, yaml or a daemon module for ``load`` and ``latest``.
"""

import importlib
from typing import Any

from datastates.protocol import errors
from datastates.protocol.version import FORMAT_VERSION, PROTOCOL_VERSION

__version__ = "0.1.0"

_LAZY = {
    "Client": "datastates.client.client",
    "CheckpointManager": "datastates.integrations.manager",
    "CheckpointEngine": "datastates.integrations.datastates_llm",
    "load": "datastates.client.reader.restore",
    "latest": "datastates.client.locate",
}
"""Each public name → the module that defines it, imported when the name is first asked for."""

__all__ = ["FORMAT_VERSION", "PROTOCOL_VERSION", "errors", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
