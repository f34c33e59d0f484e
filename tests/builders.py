"""Shared test builders: a base transformer and its perturbed actor as real FSDP rank files."""

from __future__ import annotations

import copy
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.tensor  # noqa: F401

from mergeflow.config import ModelMergerConfig
from mergeflow.demo.checkpoints import (
    build_transformer,
    perturb_,
    save_base_transformer,
    save_fsdp_checkpoint,
)


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


def gguf_py_q8_0(values: object) -> np.ndarray:
    """ggml's Q8_0 of a float32 array by gguf-py (`gguf.quants.quantize`, bit for bit ggml's reference): the
    bytes the writer's own quantizer (`q8_0_quantize_run`) is held to."""
    import gguf

    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)


def float64_q8_0_errors(source: torch.Tensor, stored: np.ndarray, dequantized: torch.Tensor) -> dict[str, float]:
    """The Q8_0 errors the writer records, computed plainly in float64 over the whole tensor: the max abs
    error, the max error relative to each block's max |x| (0 for an all-zero block) and the max ratio of a
    block's error to its bound (inf where a scale overflowed float16). The reference `q8_0_encode`'s
    float32 errors, refined where a maximum could be, are held to."""
    from mergeflow.formats.gguf_quant import Q8_0_BLOCK, q8_0_bounds, q8_0_scales

    x = source.to(torch.float64).reshape(-1, Q8_0_BLOCK)
    err = torch.nan_to_num((x - dequantized.to(torch.float64).reshape(-1, Q8_0_BLOCK)).abs().amax(dim=1),
                           nan=torch.inf)
    amax = x.abs().amax(dim=1)
    bounds = torch.from_numpy(q8_0_bounds(q8_0_scales(np.asarray(stored))))
    rel = torch.where(amax > 0, err / torch.where(amax > 0, amax, 1.0), 0.0)
    ratio = torch.nan_to_num(err / bounds, nan=torch.inf)
    return {"max_abs_error": float(err.max()), "max_rel_error": float(rel.max()), "bound_ratio": float(ratio.max())}


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


# --- for refusal tests: pristine checkpoints copied, and the merge flow's steps without Prefect ------


def clone_export(ex: Export, root: Path) -> Export:
    """A copy of `ex`'s base and checkpoint under `root` (much cheaper than building them with torch again)."""
    import shutil

    for top in {ex.actor_dir.relative_to(ex.root).parts[0], ex.base_dir.relative_to(ex.root).parts[0]}:
        shutil.copytree(ex.root / top, root / top, symlinks=True)
    return Export(root, root / ex.actor_dir.relative_to(ex.root), root / ex.base_dir.relative_to(ex.root), ex.actor, ex.class_name)


@dataclass
class PlainRun:
    """How far `plain_export` got: `stage` names the step that was running when it stopped ("done" after publishing)."""

    stage: str = ""
    plan: object = None


# stage -> the domain function it runs (through the thin task's `.fn`, which only unpacks the plan's fields)
PLAIN_STAGES = {
    "inspect": "mergeflow.export.plan.build.build_plan",
    "lock": "mergeflow.io.fs.TargetLock.acquire",
    "target": "mergeflow.io.staging.check_target",
    "index": "mergeflow.sources.verl_ranks.index_rank_file",
    "reconstruct": "mergeflow.export.reconstruct.layout.rank_layouts, then mergeflow.export.reconstruct.rebuild.plan_tensor_writes",
    "write": "mergeflow.export.write.shard_writer.write_shard_file",
    "copy": "mergeflow.export.write.copy_files.copy_base_files",
    "hash": "mergeflow.sources.verl_ranks.hash_rank_file",
    "metadata": "mergeflow.export.publish.finalize_staging",
    "validate": "mergeflow.export.check.staged_check.validate_staged",
    "seal": "mergeflow.export.publish.seal_staged",
    "publish": "mergeflow.export.publish.publish_staged",
}


def plain_export(config: ModelMergerConfig, run: PlainRun | None = None) -> dict[str, str]:
    """flows/merge.py's merge_flow + run_export for an export without LoRA or a tensor conversion, as plain calls.

    No flow run, no task runner, no result cache: each step calls the domain function (the task's
    `.fn`) in the flow's order, with the flow's lock, kept-staging and export session.
    """
    from mergeflow.errors import MergeflowError
    from mergeflow.export.plan.build import build_plan
    from mergeflow.io.fs import TargetLock
    from mergeflow.io.session import export_session
    from mergeflow.io.staging import settle_failed_staging

    run = run if run is not None else PlainRun()
    with export_session():  # as merge_flow: this export's state, dropped after it
        run.stage = "inspect"
        config.validate()  # merge_model's first step
        plan = run.plan = build_plan(config)
        run.stage = "lock"
        lock = TargetLock(Path(plan.output.lock)).acquire()
        try:
            result = _plain_run_export(plan, run)
        except MergeflowError as exc:
            raise settle_failed_staging(exc, Path(plan.output.staging)) from None
        finally:
            lock.release()
    run.stage = "done"
    return result


def _plain_run_export(plan, run: PlainRun) -> dict[str, str]:  # type: ignore[no-untyped-def]
    from mergeflow.io.staging import check_target
    from mergeflow.tasks.copy_components import copy_components
    from mergeflow.tasks.layouts import combine_rank_layouts
    from mergeflow.tasks.load import hash_rank, load_rank_shards
    from mergeflow.tasks.publish import publish, seal, write_metadata
    from mergeflow.tasks.reconstruct import plan_reconstruction
    from mergeflow.tasks.validate import validate_staged_task
    from mergeflow.tasks.write import write_shard

    if plan.lora is not None or plan.conversion.adapter is not None:
        raise NotImplementedError("plain_export covers exports without LoRA and without a tensor conversion")
    run.stage = "target"
    check_target(Path(plan.output.target))
    ranks = range(plan.checkpoint.world_size)
    run.stage = "index"
    indexes = [load_rank_shards.fn(plan, rank) for rank in ranks]
    run.stage = "reconstruct"
    output = plan_reconstruction.fn(plan, combine_rank_layouts.fn(indexes))  # the writes, packed into shards
    run.stage = "write"
    records = [write_shard.fn(plan, shard) for shard in output.shards]
    run.stage = "copy"
    copied = copy_components.fn(plan) if plan.base.copy_files else None
    run.stage = "hash"
    digests = {plan.checkpoint.rank_files[rank]: hash_rank.fn(plan, rank) for rank in ranks}
    run.stage = "metadata"
    manifest = write_metadata.fn(plan, output, digests, records, list(copied.files) if copied else None, None)
    run.stage = "validate"
    report = validate_staged_task.fn(plan, manifest, {plan.output.relative(r.file_name): r.verified() for r in records})
    run.stage = "seal"
    sealed = seal.fn(plan, report)
    run.stage = "publish"
    return publish.fn(plan, report, sealed)


def assert_nothing_published(ex: Export, target: Path, err: Exception, inputs_before: tuple) -> None:
    assert not target.exists(), "a target was published"
    staging = getattr(err, "staging_dir", None)
    left = leftovers(target.parent, f".{target.name}.")
    assert all(".mergeflow-staging-" in name for name in left), left  # no lock file, no stray files
    if left:
        assert staging is not None and Path(staging).name in left, "staging kept but not reported"
    assert (tree_digest(ex.actor_dir.parent), tree_digest(ex.base_dir)) == inputs_before, "inputs were modified"
    assert "\n" not in str(err)


def expect_refusal(ex: Export, error: type[Exception], match: str | None = None, *, stage: str,
                   **overrides: object) -> Exception:
    """Run the export's steps without Prefect (plain_export); `stage` must refuse with `error`, publishing nothing."""
    target = Path(str(overrides.pop("target", ex.root / "out")))
    inputs_before = tree_digest(ex.actor_dir.parent), tree_digest(ex.base_dir)
    run = PlainRun()
    with pytest.raises(error, match=match) as info:
        plain_export(ex.config(target, **overrides), run)
    assert run.stage == stage, f"refused at step {run.stage!r}, expected at {stage!r}: {info.value}"
    assert_nothing_published(ex, target, info.value, inputs_before)
    return info.value
