"""`mergeflow demo`: the first command a newcomer runs: a tiny real export, end to end."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from mergeflow.config import ModelMergerConfig
from mergeflow.flows.api import merge_model, validate_artifact
from mergeflow.io.jsonfiles import JsonObject


def run_demo(workdir: str | None = None, *, class_name: str = "FluxTransformer2DModel", world_size: int = 4) -> JsonObject:
    """Build a W=4 FSDP2 checkpoint of a tiny transformer, export it, validate the result."""
    from mergeflow.demo.checkpoints import build_demo_checkpoint

    root = Path(workdir).expanduser().resolve() if workdir else Path(tempfile.mkdtemp(prefix="mergeflow-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"mergeflow demo: building a tiny {class_name} checkpoint (W={world_size}) in {root}", file=sys.stderr)
    demo = build_demo_checkpoint(root, class_name=class_name, world_size=world_size)
    target = root / "exported"
    config = ModelMergerConfig(
        operation="merge",
        local_dir=str(demo.actor_dir),
        base_model=str(demo.base_dir),
        target_dir=str(target),
        output_format="transformer",
    )
    result = merge_model(config)
    check = validate_artifact(result.output_dir)
    print(f"mergeflow demo: exported to {result.output_dir}; validation {check['integrity']}", file=sys.stderr)
    print(f"mergeflow demo: try `mergeflow test --backend fsdp --test_hf_dir {result.output_dir}`", file=sys.stderr)
    return {"demo_dir": str(root), "output_dir": result.output_dir, "manifest_path": result.manifest_path,
            "integrity": check["integrity"], "architecture": check["architecture"]}
