"""Real FSDP2 rank files, written in one process: what verl saves, at any size.

`save_fsdp_checkpoint` joins a `fake` process group once per rank, applies the real
`fully_shard` to a copy of the model and `torch.save`s that copy's `state_dict()`, so the
files hold genuine DTensors with genuine `torch.chunk` sharding (padding included).
"""

from __future__ import annotations

import copy
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mergeflow.demo.sizing import scaled_overrides
from mergeflow.demo.tiny_transformers import (
    TINY_TRANSFORMER_CONFIGS,
    build_transformer,
    perturb_,
    run_tiny_forward,
    tiny_forward_inputs,
)

__all__ = [
    "TINY_TRANSFORMER_CONFIGS",
    "DemoCheckpoint",
    "build_demo_checkpoint",
    "build_sized_checkpoint",
    "build_transformer",
    "perturb_",
    "run_tiny_forward",
    "save_base_transformer",
    "save_fsdp_checkpoint",
    "tiny_forward_inputs",
]


@dataclass(frozen=True)
class DemoCheckpoint:
    """Where a synthetic training checkpoint and its base transformer were written."""

    actor_dir: Path
    base_dir: Path
    class_name: str
    world_size: int


def save_fsdp_checkpoint(
    model: nn.Module,
    actor_dir: Path,
    world_size: int,
    *,
    mesh_shape: tuple[int, int] | None = None,
    fsdp_version: int = 2,
    plain: bool = False,
    write_hf_config: bool = True,
    write_extra_state: bool = True,
) -> Path:
    """Write `actor_dir` as verl does: per-rank model (+ optim, extra_state) files and configs."""
    _check_layout(world_size, mesh_shape, fsdp_version, plain)
    actor_dir = Path(actor_dir)
    actor_dir.mkdir(parents=True, exist_ok=True)
    if plain:
        torch.save(model.state_dict(), actor_dir / _rank_file("model", 1, 0))
    else:
        _save_sharded_ranks(model, actor_dir, world_size, mesh_shape)
    if write_extra_state:
        _save_training_state(model, actor_dir, world_size)
    (actor_dir / "fsdp_config.json").write_text(
        json.dumps({"FSDP_version": fsdp_version, "world_size": world_size}, indent=4)
    )
    # Only Diffusers models (ConfigMixin) carry a config; a hand-made nn.Module has none to write.
    if write_hf_config and hasattr(model, "save_config"):
        model.save_config(actor_dir / "huggingface")
    return actor_dir


def _check_layout(
    world_size: int, mesh_shape: tuple[int, int] | None, fsdp_version: int, plain: bool
) -> None:
    """Refuse argument combinations that training could never have produced."""
    if not plain and dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed process group is already initialised in this process; "
            "synthetic checkpoints need to create (and destroy) their own fake one"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fsdp_version not in (1, 2):
        raise ValueError(f"fsdp_version must be 1 or 2, got {fsdp_version}")
    if plain and (world_size != 1 or mesh_shape is not None):
        raise ValueError("plain=True writes one unsharded file: it needs world_size=1 and no mesh_shape")
    if mesh_shape is not None:
        if len(mesh_shape) != 2 or min(mesh_shape) < 1 or mesh_shape[0] * mesh_shape[1] != world_size:
            raise ValueError(f"mesh_shape {mesh_shape} must be (replicas, shards) with product {world_size}")


def _rank_file(kind: str, world_size: int, rank: int) -> str:
    """verl's per-rank file name, e.g. `model_world_size_4_rank_0.pt`."""
    return f"{kind}_world_size_{world_size}_rank_{rank}.pt"


def _save_sharded_ranks(
    model: nn.Module, actor_dir: Path, world_size: int, mesh_shape: tuple[int, int] | None
) -> None:
    """Write one model rank file per rank of a 1-D (FSDP) or 2-D (HSDP) mesh."""
    if mesh_shape is None:
        shape, names = (world_size,), ("fsdp",)
    else:
        shape, names = tuple(mesh_shape), ("ddp", "fsdp")
    # init_process_group wraps sys.excepthook (prefixing "[rankN]: " to every traceback) and
    # never unwraps it; the caller's process must not inherit W stacked prefixes.
    caller_excepthook = sys.excepthook
    try:
        for rank in range(world_size):
            _save_one_rank(model, actor_dir, world_size, rank, shape, names)
    finally:
        sys.excepthook = caller_excepthook


def _save_one_rank(
    model: nn.Module,
    actor_dir: Path,
    world_size: int,
    rank: int,
    shape: tuple[int, ...],
    names: tuple[str, ...],
) -> None:
    """Join a fake process group as `rank`, `fully_shard` an aliasing copy, save its state dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Importing fake_pg registers the "fake" backend: collectives are no-ops, ranks are what we say.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        replica = _aliasing_copy(model)
        # verl wraps every block class named in `_no_split_modules`, then the root.
        block_classes = set(getattr(model, "_no_split_modules", None) or ())
        for module in list(replica.modules()):
            if module is not replica and type(module).__name__ in block_classes:
                fully_shard(module, mesh=mesh)
        fully_shard(replica, mesh=mesh)
        torch.save(replica.state_dict(), actor_dir / _rank_file("model", world_size, rank))
        del replica
    finally:
        dist.destroy_process_group()
        # FSDP state forms reference cycles; collect them so that only one rank's shard is
        # alive at a time instead of all W of them.
        gc.collect()


def _aliasing_copy(model: nn.Module) -> nn.Module:
    """Deep-copy the module structure while sharing every parameter's and buffer's storage."""
    # fully_shard replaces parameters on the module it is given and copies only this rank's
    # chunk, reading the originals without writing them. Sharing storage keeps memory at one
    # model plus one shard, whatever the model size; tied parameters stay tied via the memo.
    memo: dict[int, object] = {}
    for param in model.parameters():
        memo.setdefault(id(param), nn.Parameter(param.detach(), requires_grad=param.requires_grad))
    for buffer in model.buffers():
        memo.setdefault(id(buffer), buffer.detach())
    return copy.deepcopy(model, memo)


def _save_training_state(model: nn.Module, actor_dir: Path, world_size: int) -> None:
    """Write small optimizer / extra-state files like training's (mergeflow must ignore them)."""
    n_params = len(list(model.parameters()))
    for rank in range(world_size):
        optim = {
            "state": {},
            "param_groups": [{"lr": 1e-5, "betas": (0.9, 0.999), "params": list(range(n_params))}],
        }
        extra = {
            "lr_scheduler": {"last_epoch": 1, "_step_count": 2},
            "rng": {"cpu": torch.Generator().manual_seed(rank).get_state()},
        }
        torch.save(optim, actor_dir / _rank_file("optim", world_size, rank))
        torch.save(extra, actor_dir / _rank_file("extra_state", world_size, rank))


def save_base_transformer(
    model: nn.Module, base_dir: Path, *, max_shard_size: int | str | None = None
) -> Path:
    """Save the unperturbed base as a standalone Diffusers transformer directory."""
    base_dir = Path(base_dir)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(base_dir, safe_serialization=True, **kwargs)
    return base_dir


def build_demo_checkpoint(
    root: Path, *, class_name: str = "FluxTransformer2DModel", world_size: int = 4,
    config_overrides: dict[str, Any] | None = None,
) -> DemoCheckpoint:
    """Write a tiny base (`root/base`) and its perturbed FSDP2 actor (`root/global_step_1/actor`)."""
    root = Path(root)
    base = build_transformer(class_name, seed=0, config_overrides=config_overrides)
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    perturb_(actor, seed=1)
    actor_dir = save_fsdp_checkpoint(actor, root / "global_step_1" / "actor", world_size)
    return DemoCheckpoint(actor_dir, base_dir, class_name, world_size)


def build_sized_checkpoint(
    root: Path,
    size_bytes: int,
    *,
    world_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    class_name: str = "FluxTransformer2DModel",
) -> DemoCheckpoint:
    """Write a base + FSDP2 actor of a real transformer whose weights total ~`size_bytes` (±15%)."""
    root = Path(root)
    overrides = scaled_overrides(class_name, size_bytes, dtype)
    model = build_transformer(class_name, seed=0, dtype=dtype, config_overrides=overrides)
    base_dir = save_base_transformer(model, root / "base")
    # The base is on disk now, so the actor is the same model perturbed in place: one copy
    # of the weights in memory instead of two.
    perturb_(model, seed=1)
    actor_dir = save_fsdp_checkpoint(model, root / "global_step_1" / "actor", world_size)
    return DemoCheckpoint(actor_dir, base_dir, class_name, world_size)
