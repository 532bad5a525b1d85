"""``datastates.llm.Checkpointing``: the name DataStates-LLM's own examples and tests use for its engine.

The same class as ``datastates.CheckpointEngine`` (integrations/datastates_llm.py), built
from a DeepSpeed-like config object or a plain dict: ``Checkpointing(runtime_config={}, rank=0)``.
"""

from datastates.integrations.datastates_llm import CheckpointEngine

Checkpointing = CheckpointEngine

__all__ = ["Checkpointing", "CheckpointEngine"]
