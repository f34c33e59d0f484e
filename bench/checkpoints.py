"""The checkpoints the benchmarks export: real model depth, or a total size.

Built in a child process, so the model's heap goes with it instead of crowding the page
cache that the floor and the exports then use.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A benchmark shape: a Diffusers class with config overrides (or a total size), ranks, dtype."""

    name: str
    world_size: int
    dtype: str
    overrides: dict[str, Any] | None = None  # exact config overrides; else scaled to size_bytes
    size_bytes: int = 0
    class_name: str = "FluxTransformer2DModel"


def _flux_widths(double_blocks: int, single_blocks: int) -> dict[str, Any]:
    """FLUX.1's widths at 8 heads of 128 instead of 24, at a chosen depth.

    Its input and output widths are FLUX.1's (64 latent channels in and out, 4096 text, 768 pooled), so
    every layer takes a LoRA extraction of rank 32 (the tiny model's 2- to 7-wide ones are refused above 2).
    """
    return {"num_attention_heads": 8, "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56),
            "num_layers": double_blocks, "num_single_layers": single_blocks, "in_channels": 64, "out_channels": 64,
            "joint_attention_dim": 4096, "pooled_projection_dim": 768}


PRESETS = {
    # FLUX.1's depth (19 double + 38 single blocks, 1,160 state-dict entries): the tensor count and rank
    # count of the real model, 5.3 GB of float32.
    "real-depth": Preset("real-depth", world_size=8, dtype="float32", overrides=_flux_widths(19, 38)),
    # Half of it (10 double + 19 single blocks), the same widths: with real-depth, two depths of one
    # architecture, so a peak-memory figure can be shown flat (or not) as the model grows.
    "half-depth": Preset("half-depth", world_size=8, dtype="float32", overrides=_flux_widths(10, 19)),
    # The old default: ~1 GB in 62 tensors over 4 ranks (few, large tensors).
    "1gb": Preset("1gb", world_size=4, dtype="bfloat16", size_bytes=10**9),
}


def _build(conn: Any, root: str, preset: Preset, layouts: tuple[str, ...]) -> None:
    import torch

    from mergeflow.demo.checkpoints import (
        build_sized_checkpoint,
        build_transformer,
        perturb_,
        save_base_transformer,
        save_fsdp_checkpoint,
    )

    dtype = getattr(torch, preset.dtype)
    if preset.overrides is None:
        demo = build_sized_checkpoint(Path(root), preset.size_bytes, world_size=preset.world_size, dtype=dtype,
                                      class_name=preset.class_name)
        conn.send(([str(demo.actor_dir)] * len(layouts), str(demo.base_dir)))  # verl only (checked above)
        return
    model = build_transformer(preset.class_name, seed=0, dtype=dtype, config_overrides=preset.overrides)
    base = save_base_transformer(model, Path(root) / "base")
    perturb_(model, seed=1)  # the base is on disk: perturb in place, one copy of the weights in memory
    dirs: list[str] = []
    for layout in layouts:  # every layout holds the same weights: the same model, saved each way
        if layout == "dcp":
            import torch.distributed.checkpoint as dcp

            # One writer (no process group): every tensor is one chunk of one .distcp file, as a W=1
            # accelerate save writes it; W writers would need W processes each holding its slice.
            dcp_dir = Path(root) / "pytorch_model_fsdp_0"
            dcp.save({"model": model.state_dict()}, checkpoint_id=str(dcp_dir), no_dist=True)
            dirs.append(str(dcp_dir))
        else:
            dirs.append(str(save_fsdp_checkpoint(model, Path(root) / "global_step_1" / "actor", preset.world_size,
                                                 write_extra_state=False)))
    conn.send((dirs, str(base)))


def build_checkpoint(root: Path, preset: Preset, layout: str = "verl") -> tuple[Path, Path]:
    """(checkpoint dir, base dir) of the preset's checkpoint, written under `root` by a child process.

    layout: "verl" (the preset's W rank files) or "dcp" (a torch DCP of one writer; presets with overrides only).
    """
    dirs, base = build_checkpoints(root, preset, (layout,))
    return dirs[layout], base


def build_checkpoints(root: Path, preset: Preset, layouts: tuple[str, ...]) -> tuple[dict[str, Path], Path]:
    """({layout: checkpoint dir}, base dir): the same model saved in each layout, by one child process."""
    if "dcp" in layouts and preset.overrides is None:
        raise ValueError(f"preset {preset.name} has no fixed config: a DCP is built only for presets with overrides")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_build, args=(child, str(root), preset, layouts))
    proc.start()
    child.close()  # the child's end only in the child: a child that dies ends the pipe instead of hanging recv()
    try:
        dirs, base = parent.recv()
    except EOFError:
        proc.join()
        raise SystemExit(f"building the {preset.name} checkpoint failed (the builder exited with {proc.exitcode})") from None
    proc.join()
    return {layout: Path(d) for layout, d in zip(layouts, dirs, strict=True)}, Path(base)
