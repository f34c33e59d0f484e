"""Where an exported adapter lies: `lora_adapter/` (its checks: mergeflow/outputs/lora_adapter.py).

An adapter directory is an artifact of its own (its manifest lists its files and tensors), so it can
be validated wherever it is copied. When it sits inside a model export, the root manifest also lists
its three files, so the root's file tree stays exact. A LoRA-only adapter export has no root
manifest: its target holds `lora_adapter/` and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import MANIFEST_NAME

ADAPTER_DIR = "lora_adapter"
ADAPTER_MANIFEST = f"{ADAPTER_DIR}/{MANIFEST_NAME}"


def adapter_only_root(root: Path) -> Path | None:
    """`root/lora_adapter` when root is a LoRA-only adapter export (no root manifest, nothing else)."""
    if (root / MANIFEST_NAME).exists() or (root / MANIFEST_NAME).is_symlink():
        return None
    inner = root / ADAPTER_DIR
    if inner.is_symlink() or not (inner / MANIFEST_NAME).is_file():
        return None
    others = sorted(p.name for p in root.iterdir() if p.name != ADAPTER_DIR)
    if others:
        raise ArtifactInvalidError(f"{others[0]} lies beside {ADAPTER_DIR}/ in an adapter-only export; it is not listed anywhere")
    return inner
