"""`mergeflow inspect`: what a checkpoint is, from its metadata alone (no tensor data)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.sources.base import CheckpointDescription
from mergeflow.sources.registry import source_for


def describe_checkpoint(actor_dir: Path, *, trust_checkpoint: bool = False) -> CheckpointDescription:
    """What is this checkpoint? World size, layout, tensors, dtypes, LoRA adapters, class (its source says)."""
    actor_dir = actor_dir.expanduser().resolve()
    return source_for(actor_dir).describe(actor_dir, trust_checkpoint=trust_checkpoint)
