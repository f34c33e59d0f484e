"""End to end: real rank files -> the merge flow on a real Prefect server -> a published artifact."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from builders import assert_bit_exact, leftovers, make_export, output_state, tree_digest
from prefect_runs import latest_flow_run

from mergeflow import merge_model, validate_artifact
from mergeflow.demo.checkpoints import run_tiny_forward
from mergeflow.errors import ArtifactInvalidError
from mergeflow.io.session import active_session

CLASSES = [
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
    "QwenImageTransformer2DModel",
    "WanTransformer3DModel",
    "LTX2VideoTransformer3DModel",
    "MiniMaxH3Transformer3DModel",
]


def _published_state(out: Path) -> dict[str, torch.Tensor]:
    assert not leftovers(out.parent, f".{out.name}"), "staging or lock left behind"
    assert (out / "merge_manifest.json").is_file()
    for p in out.rglob("*"):
        assert p.stat().st_mode & 0o044 == 0o044, f"{p} is not world/group readable"
    return output_state(out)


@pytest.mark.parametrize("class_name", CLASSES)
def test_every_transformer_class_is_bit_exact_and_loads(tmp_path: Path, prefect_api: object, class_name: str) -> None:
    ex = make_export(tmp_path, class_name, world_size=3)
    result = merge_model(ex.config())
    out = Path(result.output_dir)
    assert_bit_exact(ex.actor.state_dict(), _published_state(out))
    import diffusers

    loaded = getattr(diffusers, class_name).from_pretrained(out, local_files_only=True)
    expected = run_tiny_forward(ex.actor.eval())
    actual = run_tiny_forward(loaded.eval())
    # Same weights bit for bit; kernels may order float sums differently across two module instances.
    for a, b in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert validate_artifact(out) == {"integrity": "passed", "architecture": class_name}


@pytest.mark.parametrize(
    "world_size,mesh_shape,plain,fsdp_version",
    [(1, None, False, 2), (2, None, False, 2), (4, None, False, 2), (4, (2, 2), False, 2), (1, None, True, 2), (3, None, False, 1)],
    ids=["w1", "w2", "w4", "hsdp2x2", "plain-w1", "fsdp1-dtensor-w3"],
)
def test_world_sizes_and_meshes(tmp_path: Path, prefect_api: object, world_size: int, mesh_shape, plain: bool, fsdp_version: int) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", world_size, mesh_shape=mesh_shape, plain=plain, fsdp_version=fsdp_version)
    result = merge_model(ex.config())
    assert_bit_exact(ex.actor.state_dict(), _published_state(Path(result.output_dir)))
    manifest = json.loads(Path(result.manifest_path).read_text())
    expected_sources = {f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)} | {"fsdp_config.json"}
    assert set(manifest["source_files"]) == expected_sources
    for name, digest in manifest["source_files"].items():  # hashed in their own tasks, beside the writers
        assert digest == hashlib.sha256((ex.actor_dir / name).read_bytes()).hexdigest(), name
    # What the export kept (its parsed rank files, digests) was its own session's: none is left set here.
    assert active_session() is None


def test_multi_shard_output_with_index(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "SD3Transformer2DModel", 4)
    result = merge_model(ex.config(max_shard_size=20_000))
    out = Path(result.output_dir)
    index = json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and all("-of-" in s for s in shards)
    assert set(index["weight_map"].values()) == set(shards)
    assert_bit_exact(ex.actor.state_dict(), output_state(out))
    from diffusers import SD3Transformer2DModel

    SD3Transformer2DModel.from_pretrained(out, local_files_only=True)
    manifest = json.loads(Path(result.manifest_path).read_text())
    assert manifest["max_shard_size_bytes"] == 20_000
    assert set(manifest["files"]) == set(shards) | {"README.md", "config.json", "diffusion_pytorch_model.safetensors.index.json"}


def test_bfloat16_cast_keeps_fp32_modules(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "WanTransformer3DModel", 2)
    result = merge_model(ex.config(dtype="bfloat16"))
    state = output_state(Path(result.output_dir))
    keep = type(ex.actor)._keep_in_fp32_modules
    kept = 0
    for key, value in ex.actor.state_dict().items():
        if any(m in key.split(".") for m in keep):
            kept += 1
            assert state[key].dtype == torch.float32 and torch.equal(state[key], value.float()), key
        else:
            assert state[key].dtype == torch.bfloat16 and torch.equal(state[key], value.to(torch.bfloat16)), key
    assert kept > 0
    assert json.loads(Path(result.manifest_path).read_text())["dtype"] == "bfloat16"


def test_mixed_dtype_checkpoint_preserved(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "WanTransformer3DModel", 3, dtype=torch.bfloat16)
    dtypes = {v.dtype for v in ex.actor.state_dict().values()}
    assert {torch.bfloat16, torch.float32} <= dtypes
    result = merge_model(ex.config())
    assert_bit_exact(ex.actor.state_dict(), output_state(Path(result.output_dir)))


def test_manifest_fields_and_no_local_paths(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    base_cfg = json.loads((ex.base_dir / "config.json").read_text())
    base_cfg["_name_or_path"] = str(ex.base_dir)
    (ex.base_dir / "config.json").write_text(json.dumps(base_cfg))
    result = merge_model(ex.config())
    out = Path(result.output_dir)
    text = "".join(p.read_text(errors="ignore") for p in out.glob("*.json"))
    assert str(tmp_path) not in text
    manifest = json.loads(Path(result.manifest_path).read_text())
    assert manifest["schema_version"] == 1 and manifest["artifact_type"] == "diffusers_transformer"
    assert manifest["tensor_directory"] == "." and manifest["backend"] == "fsdp"
    assert manifest["config_transform"] == {"removed_keys": {"config.json": ["_name_or_path"]}}
    assert manifest["verification"] == {"structure": "passed", "source_round_trip": "passed",
                                        "artifact_round_trip": "passed", "integrity": "passed", "runtime": "not_run"}
    assert (out / "merge_manifest.json").read_text() == json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    assert set(manifest["files"]) == {"README.md", "config.json", "diffusion_pytorch_model.safetensors"}


def test_test_command_catches_a_flipped_byte_in_every_file(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)
    out = Path(merge_model(ex.config(max_shard_size=60_000)).output_dir)
    files = sorted(tree_digest(out))
    assert len(files) >= 4
    for rel in files:
        copy = tmp_path / f"copy-{rel.replace('/', '_')}"
        shutil.copytree(out, copy)
        data = bytearray((copy / rel).read_bytes())
        data[len(data) // 2] ^= 0x01
        (copy / rel).write_bytes(bytes(data))
        with pytest.raises(ArtifactInvalidError):
            validate_artifact(copy)
    extra = tmp_path / "copy-extra"
    shutil.copytree(out, extra)
    (extra / "notes.txt").write_text("x")
    with pytest.raises(ArtifactInvalidError, match="not in the manifest"):
        validate_artifact(extra)


def test_flow_artifacts_are_readable_through_the_client(tmp_path: Path, prefect_api: object) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    ex = make_export(tmp_path, "FluxTransformer2DModel", 2)  # <tmp>/ckpt/global_step_1/actor: run "ckpt", step 1
    target = tmp_path / "artifact-check"
    merge_model(ex.config(target))
    run = latest_flow_run("merge-ckpt-step1")
    keys = ("merge-manifest-ckpt-step1", "merge-summary-ckpt-step1", "merge-progress-ckpt-step1")

    async def read() -> dict[str, object]:
        async with get_client() as client:
            found = {}
            for key in keys:  # the keys name the training run and step; this run's versions only
                arts = await client.read_artifacts(artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=[key]), flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
                found[key] = arts
            return found

    found = asyncio.run(read())
    table = found["merge-manifest-ckpt-step1"][0]
    assert table.type == "table"
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert {r["file"] for r in rows} == {"README.md", "config.json", "diffusion_pytorch_model.safetensors"}
    assert {r["file"]: r["bytes"] for r in rows} == {r["file"]: (target / r["file"]).stat().st_size for r in rows}
    assert found["merge-summary-ckpt-step1"][0].type == "markdown"
    progress = found["merge-progress-ckpt-step1"][0]
    assert progress.type == "progress" and float(progress.data) == 100.0


def test_the_merge_flow_imports_tasks_records_and_flow_helpers_only() -> None:
    """flows/merge.py is the recipe: its domain work runs in tasks (or flows/export_run.py), so it imports no
    mergeflow domain module beyond the records, the config (its result's type too) and the errors."""
    import ast

    import mergeflow.flows.merge as merge

    tree = ast.parse(Path(merge.__file__).read_text())
    allowed = {"mergeflow.records", "mergeflow.config", "mergeflow.errors"}
    found: list[str] = []
    for node in ast.walk(tree):  # nested imports too
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] == "mergeflow"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mergeflow":
            found.append(node.module)
    layers = ("mergeflow.tasks.", "mergeflow.flows.")
    domain = sorted({m for m in found if m not in allowed and not m.startswith(layers)})
    assert not domain, f"flows/merge.py imports domain modules: {domain}"
    assert any(m.startswith("mergeflow.tasks.") for m in found)  # the rule is checked on the real import list
