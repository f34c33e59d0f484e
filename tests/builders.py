"""Shared test builders: a base transformer and its perturbed actor as real FSDP rank files."""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.tensor  # noqa: F401

from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import build_transformer, perturb_, save_base_transformer, save_fsdp_checkpoint


@dataclass
class Export:
    root: Path
    actor_dir: Path
    base_dir: Path
    actor: torch.nn.Module
    class_name: str

    def config(self, target: Path | str | None = None, **overrides: object) -> ModelMergerConfig:
        values: dict[str, object] = dict(
            operation="merge",
            local_dir=str(self.actor_dir),
            base_model=str(self.base_dir),
            target_dir=str(target or self.root / "out"),
            output_format="transformer",
        )
        values.update(overrides)
        return ModelMergerConfig(**values)  # type: ignore[arg-type]


def make_export(
    root: Path,
    class_name: str = "FluxTransformer2DModel",
    world_size: int = 4,
    *,
    mesh_shape: tuple[int, int] | None = None,
    dtype: torch.dtype | None = None,
    plain: bool = False,
    fsdp_version: int = 2,
) -> Export:
    base = build_transformer(class_name, seed=0, dtype=dtype)
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    perturb_(actor, seed=1)
    actor_dir = save_fsdp_checkpoint(
        actor, root / "ckpt" / "global_step_1" / "actor", world_size,
        mesh_shape=mesh_shape, plain=plain, fsdp_version=fsdp_version,
    )
    return Export(root, actor_dir, base_dir, actor, class_name)


def output_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors directory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_bit_exact(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert set(expected) == set(actual)
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        a = value.detach().contiguous().reshape(-1).view(torch.uint8)
        b = got.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{key} differs"


def tree_digest(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(parent: Path, target_name: str) -> list[str]:
    """Entries beside a target that an export may have left (staging, lock, the target)."""
    return sorted(p.name for p in parent.iterdir() if target_name in p.name)
