"""Hand-made rank files for refusal tests: DTensors built under a fake process group."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.tensor  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


def save_custom_ranks(
    actor_dir: Path,
    world_size: int,
    build: Callable[[int, DeviceMesh], dict[str, Any]],
    *,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_dim_names: tuple[str, ...] = ("fsdp",),
) -> Path:
    """Write rank files whose contents `build(rank, mesh)` returns, as real torch.save output."""
    actor_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            mesh = init_device_mesh("cpu", mesh_shape or (world_size,), mesh_dim_names=mesh_dim_names)
            torch.save(build(rank, mesh), actor_dir / f"model_world_size_{world_size}_rank_{rank}.pt")
        finally:
            dist.destroy_process_group()
    (actor_dir / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4))
    return actor_dir


def rewrite_rank(path: Path, change: Callable[[dict[str, Any]], object]) -> None:
    """Load a rank file fully, let `change` edit the dict in place (its return value is ignored), save it."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    change(state)
    torch.save(state, path)


def replace_rank(path: Path, make: Callable[[dict[str, Any]], object]) -> None:
    """Replace a rank file's content with whatever `make(state)` returns."""
    torch.save(make(torch.load(path, map_location="cpu", weights_only=True)), path)
