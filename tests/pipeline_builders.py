"""Test builders for pipeline exports: a tiny base pipeline, its perturbed actor as rank files, the export."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from builders import leftovers, tree_digest

from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import (
    perturb_,
    save_fsdp_checkpoint,
    tiny_forward_inputs,
)

WORLD_SIZE = 2


@dataclass
class Exported:
    """A base pipeline, the actor trained from it, and (once exported) the artifact."""

    base: Path
    actor_dir: Path
    actor: torch.nn.Module
    out: Path | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    def config(self, target: Path, **overrides: Any) -> ModelMergerConfig:
        values: dict[str, Any] = dict(operation="merge", local_dir=str(self.actor_dir), base_model=str(self.base),
                                      target_dir=str(target))
        values.update(overrides)
        return ModelMergerConfig(**values)


def make_actor(base_transformer: torch.nn.Module, root: Path, *, seed: int = 1) -> tuple[torch.nn.Module, Path]:
    """A perturbed copy of the base's transformer, saved as real FSDP2 rank files under root."""
    actor = copy.deepcopy(base_transformer)
    perturb_(actor, seed=seed)
    actor_dir = save_fsdp_checkpoint(actor, root / "ckpt" / "global_step_1" / "actor", WORLD_SIZE)
    return actor.eval(), actor_dir


def export(prefect_server: Any, item: Exported, target: Path, **overrides: Any) -> Exported:
    """Run mergeflow's merge flow against the session's Prefect server; fill in out and manifest."""
    from mergeflow import merge_model

    with prefect_server.activated():
        result = merge_model(item.config(target, **overrides))
    item.out = Path(result.output_dir)
    item.manifest = json.loads(Path(result.manifest_path).read_text())
    return item


def forward(model: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """One no-grad forward on the fixed tiny inputs (Flux without guidance gets none)."""
    name = type(model).__name__
    inputs = tiny_forward_inputs(name, dict(model.config))
    if name == "FluxTransformer2DModel" and not model.config.guidance_embeds:
        inputs.pop("guidance")
    with torch.no_grad():
        outputs = model.eval()(**inputs, return_dict=False)
    return tuple(o for o in outputs if isinstance(o, torch.Tensor))


def assert_same_forward(model: torch.nn.Module, actor: torch.nn.Module, run: Callable[[Any], Any] = forward) -> None:
    """Same weights bit for bit; kernels may order float sums differently across two instances."""
    for a, b in zip(run(actor), run(model), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def assert_state_equal(model: torch.nn.Module, actor: torch.nn.Module) -> None:
    """The loaded module's state dict equals the actor's bit for bit."""
    expected, actual = actor.state_dict(), model.state_dict()
    assert set(actual) == set(expected)
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8)), key


def assert_copied_unchanged(item: Exported, trained: str = "transformer") -> None:
    """Every base file outside the trained component's config/weights is in the artifact, byte for byte."""
    assert item.out is not None
    base, out = tree_digest(item.base), tree_digest(item.out)
    replaced = {rel for rel in base if rel.startswith(f"{trained}/") and rel.endswith((".safetensors", ".index.json"))}
    rewritten = item.manifest["config_transform"]["removed_keys"]  # configs that lost local-path keys
    for rel, digest in base.items():
        if rel in replaced:
            assert rel not in out or out[rel] != digest, f"{rel} still holds the base's weights"
        elif rel in rewritten:
            assert out[rel] != digest and str(item.base) not in (item.out / rel).read_text(), rel
        elif rel == "README.md":  # the base's model card: the artifact's own card takes its place
            assert item.manifest["files"]["README.md"] == out[rel] != digest, rel
        else:
            assert out.get(rel) == digest, f"{rel} differs from the base"
    assert set(out) - set(base) <= {"merge_manifest.json", "merge_manifest.sha256", "README.md"} | {r for r in out if r.startswith(f"{trained}/")}
    assert item.manifest["base_files"] == base


def refused(prefect_server: Any, item: Exported, target: Path, error: type, match: str, **overrides: Any) -> None:
    """The export fails with `error` matching `match`, and nothing is left beside the target."""
    import pytest

    from mergeflow import merge_model

    before = tree_digest(item.base)
    with prefect_server.activated(), pytest.raises(error, match=match) as info:
        merge_model(item.config(target, **overrides))
    assert "\n" not in str(info.value)
    assert not target.exists()
    assert leftovers(target.parent, target.name) == []
    assert tree_digest(item.base) == before, "the base was modified"
