"""`mergeflow demo`: the first command a newcomer runs: a tiny real export, end to end."""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from mergeflow.config import ModelMergerConfig
from mergeflow.flows.api import merge_model, validate_artifact
from mergeflow.io.jsonfiles import JsonObject


def run_demo(workdir: str | None = None, *, class_name: str = "FluxTransformer2DModel", world_size: int = 4) -> JsonObject:
    """Build a W=4 FSDP2 checkpoint of a tiny transformer, export it, validate the result.

    Without `workdir` everything is built in a temp dir that is removed at the end: a first
    try leaves nothing behind. With it, the checkpoint, base and export stay for a look.
    """
    from mergeflow.demo.checkpoints import build_demo_checkpoint

    keep = workdir is not None
    root = Path(workdir).expanduser().resolve() if workdir else Path(tempfile.mkdtemp(prefix="mergeflow-demo-"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        say(f"building a tiny {class_name} checkpoint (W={world_size}) in {root}")
        demo = build_demo_checkpoint(root, class_name=class_name, world_size=world_size)
        target = root / "exported"
        say(f"checkpoint (the training output): {demo.actor_dir}")
        say(f"base model (what training started from): {demo.base_dir}")
        say("the same export from the command line: " + merge_command(demo.actor_dir, demo.base_dir, target))
        config = ModelMergerConfig(
            operation="merge",
            local_dir=str(demo.actor_dir),
            base_model=str(demo.base_dir),
            target_dir=str(target),
            output_format="transformer",
        )
        result = merge_model(config)
        check = validate_artifact(result.output_dir)
        say(f"exported to {result.output_dir}; validation {check['integrity']}")
        if keep:
            say(f"check it again any time: mergeflow test --backend fsdp --test_hf_dir {shlex.quote(result.output_dir)}")
        return {"demo_dir": str(root), "kept": keep, "output_dir": result.output_dir, "manifest_path": result.manifest_path,
                "integrity": check["integrity"], "architecture": check["architecture"]}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
            say(f"removed {root} (pass --workdir DIR to keep the checkpoint and the export)")


def merge_command(actor_dir: Path, base_dir: Path, target: Path) -> str:
    """The `mergeflow merge` command line that does what the demo does."""
    args = ["mergeflow", "merge", "--backend", "fsdp", "--local_dir", str(actor_dir), "--base_model", str(base_dir),
            "--target_dir", str(target), "--output_format", "transformer"]
    return " ".join(shlex.quote(a) for a in args)


def say(line: str) -> None:
    print(f"mergeflow demo: {line}", file=sys.stderr)
