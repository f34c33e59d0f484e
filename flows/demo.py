"""`mergeflow demo`: the first command a newcomer runs: a tiny real export, end to end, that stays to be explored."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TypedDict

from mergeflow.config import ModelMergerConfig
from mergeflow.flows.api import merge_model, validate_artifact

DEMO_CLASS = "QwenImageTransformer2DModel"  # its tiny pipeline needs no sentencepiece and no download
# Bumped when the demo's inputs change: inputs a demo of another version built are rebuilt (2: a transformer
# its pipeline can run, for the printed `mergeflow smoke`).
DEMO_INPUTS_VERSION = "2"


def default_workdir() -> Path:
    """Where the demo keeps its work: beside mergeflow's schema cache (MERGEFLOW_CACHE_DIR, else $XDG_CACHE_HOME/mergeflow)."""
    cache = os.environ.get("MERGEFLOW_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mergeflow")
    return Path(cache) / "demo"


class DemoResult(TypedDict):
    """`mergeflow demo`'s JSON line: where it worked, what it published, and the validation's verdict."""

    demo_dir: str
    output_dir: str
    manifest_path: str
    integrity: str
    architecture: str


def run_demo(workdir: str | None = None, *, world_size: int = 4, links: list[str] | None = None) -> DemoResult:
    """Build (once) a W=4 FSDP2 checkpoint and its base pipeline, export it as a pipeline, validate it.

    Everything stays in `workdir` (printed), so the commands printed at the end run as printed;
    a second demo reuses the checkpoint and exports to the next free target.
    """
    root = Path(workdir).expanduser().resolve() if workdir else default_workdir().resolve()
    root.mkdir(parents=True, exist_ok=True)
    say(f"working in {root} (kept; remove it when done)")
    actor_dir, base_dir = demo_inputs(root, world_size)
    say(f"checkpoint (what training wrote): {actor_dir}")
    say(f"base pipeline (what training started from): {base_dir}")
    target = next_target(root)
    config = ModelMergerConfig(operation="merge", local_dir=str(actor_dir), base_model=str(base_dir),
                               target_dir=str(target))
    result = merge_model(config)
    check = validate_artifact(result.output_dir)
    say(f"exported the pipeline to {result.output_dir}; validation {check['integrity']}")
    say("try next (each runs as printed):")
    for line in next_commands(actor_dir, base_dir, Path(result.output_dir), next_target(root, "transformer")):
        say(f"  {line}")
    if links:
        say(f"this export in the Prefect UI: {links[0]}")
    return {"demo_dir": str(root), "output_dir": result.output_dir, "manifest_path": result.manifest_path,
            "integrity": check["integrity"], "architecture": check["architecture"]}


def demo_inputs(root: Path, world_size: int) -> tuple[Path, Path]:
    """The checkpoint and the base pipeline under `root`, built on the first demo and reused after."""
    actor_dir = root / "train" / "global_step_1" / "actor"
    base_dir = root / "base"
    version = root / "inputs-version"
    if (base_dir / "model_index.json").is_file() and (actor_dir / "fsdp_config.json").is_file() \
            and version.is_file() and version.read_text().strip() == DEMO_INPUTS_VERSION:
        return actor_dir, base_dir
    from diffusers import QwenImageTransformer2DModel

    from mergeflow.demo.checkpoints import build_demo_checkpoint
    from mergeflow.demo.pipeline import RUNNABLE_QWEN_IMAGE, build_qwenimage_base

    say(f"building a tiny {DEMO_CLASS} checkpoint (W={world_size}) and its base pipeline (once)")
    for stale in (root / "train", base_dir):  # an earlier version's inputs: rebuilt, never mixed with new ones
        if stale.exists():
            shutil.rmtree(stale)
    demo = build_demo_checkpoint(root / "train", class_name=DEMO_CLASS, world_size=world_size,
                                 config_overrides=RUNNABLE_QWEN_IMAGE)
    transformer = QwenImageTransformer2DModel.from_pretrained(demo.base_dir, local_files_only=True)
    partial = root / "base.partial"  # model_index.json marks a finished base: a half-built one is redone
    if partial.exists():
        shutil.rmtree(partial)
    build_qwenimage_base(partial, transformer)
    partial.rename(base_dir)  # removed above with the other inputs
    version.write_text(DEMO_INPUTS_VERSION + "\n")
    return demo.actor_dir, base_dir


def next_target(root: Path, kind: str = "pipeline") -> Path:
    """The first `exports/KIND-N` that does not exist yet."""
    n = 1
    while (root / "exports" / f"{kind}-{n}").exists():
        n += 1
    (root / "exports").mkdir(exist_ok=True)
    return root / "exports" / f"{kind}-{n}"


def next_commands(actor_dir: Path, base_dir: Path, output: Path, transformer_target: Path) -> list[str]:
    """Commands that run as printed: inspect the checkpoint, export again (transformer only), test the artifact,
    run one denoising step of it."""
    return [
        quote("mergeflow", "inspect", "--local_dir", str(actor_dir)),
        quote("mergeflow", "merge", "--backend", "fsdp", "--local_dir", str(actor_dir), "--base_model", str(base_dir),
              "--target_dir", str(transformer_target), "--output_format", "transformer"),
        quote("mergeflow", "test", "--backend", "fsdp", "--test_hf_dir", str(output)),
        quote("mergeflow", "smoke", "--test_hf_dir", str(output)),
    ]


def quote(*args: str) -> str:
    return " ".join(shlex.quote(a) for a in args)


def say(line: str) -> None:
    print(f"mergeflow demo: {line}", file=sys.stderr)
