"""The unchanged-weights guard: an export equal to its base is refused unless --allow-unchanged."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import forked_cli
import pytest
import torch
from builders import Export, leftovers, make_export, plain_export, tree_digest
from lora_builders import ATTN_TARGETS, build_lora_checkpoint
from peft import LoraConfig

from mergeflow import merge_model
from mergeflow.architectures.adapters import diffusers_schema
from mergeflow.demo.checkpoints import (
    build_transformer,
    save_base_transformer,
    save_fsdp_checkpoint,
)
from mergeflow.errors import ArtifactInvalidError, UnchangedWeightsError
from mergeflow.export.check.unchanged import MANIFEST_FIELD, measure_unchanged
from mergeflow.formats.manifest import MANIFEST_NAME, check_manifest

CLASS = "FluxTransformer2DModel"


def unchanged_export(root: Path, *, changed: str | None = None) -> Export:
    """A checkpoint of the unperturbed base (a wrong step, an untrained run); `changed`: the one tensor trained."""
    base = build_transformer(CLASS, seed=0)
    base_dir = save_base_transformer(base, root / "base")
    actor = copy.deepcopy(base)
    if changed is not None:
        with torch.no_grad():
            actor.get_parameter(changed).add_(0.5)
    actor_dir = save_fsdp_checkpoint(actor, root / "ckpt" / "global_step_1" / "actor", 2)
    return Export(root, actor_dir, base_dir, actor, CLASS)


def cli_merge(ex: Export, target: Path, env: dict[str, str], *extra: str):  # noqa: ANN201
    return forked_cli.mergeflow(["merge", "--backend", "fsdp", "--local_dir", str(ex.actor_dir), "--base_model",
                                 str(ex.base_dir), "--target_dir", str(target), "--output_format", "transformer", *extra], env)


def manifest_of(target: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((target / MANIFEST_NAME).read_text())


def test_an_export_equal_to_its_base_is_refused_then_allowed(tmp_path: Path, prefect_server) -> None:  # type: ignore[no-untyped-def]
    ex = unchanged_export(tmp_path)
    # Its model schema in this session's cache (MERGEFLOW_CACHE_DIR, which the commands inherit), built here
    # where Diffusers is imported already, not in the command, which would import it (3-5 s) for the same
    # answer: model_schema never depends on the cache (tests/test_schema_cache.py).
    diffusers_schema(json.loads((ex.actor_dir / "huggingface" / "config.json").read_text()),
                     json.loads((ex.base_dir / "config.json").read_text()))
    env = {**prefect_server.client_env(), "HF_HUB_OFFLINE": "1"}
    target = tmp_path / "out"
    refused = cli_merge(ex, target, env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = [x for x in refused.stderr.splitlines() if x.startswith("mergeflow: error:")]
    assert len(line) == 1 and "--allow-unchanged" in line[0] and "save_lora_only" in line[0], refused.stderr[-2000:]
    assert "work kept" not in line[0]
    assert leftovers(tmp_path, "out") == [], "a refused export left staging, a lock or a target behind"

    allowed = cli_merge(ex, target, env, "--allow-unchanged")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    manifest = manifest_of(target)
    assert manifest[MANIFEST_FIELD] == {"compared_tensors": len(manifest["tensors"]), "differing_tensors": 0}
    assert leftovers(tmp_path, "out") == ["out"]
    check_manifest(manifest)
    with pytest.raises(ArtifactInvalidError, match=MANIFEST_FIELD):  # the optional field is checked when present
        check_manifest({**manifest, MANIFEST_FIELD: {"compared_tensors": 1, "differing_tensors": 2}})


def test_a_normal_export_compares_only_the_sample_and_is_unchanged(tmp_path: Path, prefect_api: object) -> None:
    ex = make_export(tmp_path, CLASS, 2)
    shard_size = 64 * 1024  # several shards: the sample (one tensor each) is a small part of the model
    guarded = merge_model(ex.config(tmp_path / "guarded", max_shard_size=shard_size))
    out = Path(guarded.output_dir)
    manifest = manifest_of(out)
    assert MANIFEST_FIELD not in manifest  # not measured: the manifest is an ordinary export's
    shards = {}
    for name, file_name in json.loads((out / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"].items():
        shards.setdefault(file_name, []).append(name)
    listed = [(f, sorted(names)) for f, names in sorted(shards.items())]
    check = measure_unchanged(out, listed, ex.base_dir, "diffusion_pytorch_model.safetensors")
    assert len(listed) >= 3 and check.compared == check.sampled == len(listed) < len(manifest["tensors"])
    assert check.differing is None
    # The same export without the guard (the flow's steps as plain calls) is the same bytes, file for file.
    unguarded = plain_export(ex.config(tmp_path / "unguarded", max_shard_size=shard_size))
    assert tree_digest(Path(unguarded["output_dir"])) == tree_digest(out)


def test_one_trained_tensor_outside_the_sample_is_measured_and_recorded(tmp_path: Path, prefect_api: object) -> None:
    probe = build_transformer(CLASS, seed=0)
    last = sorted(name for name, _ in probe.named_parameters())[-1]  # never the first of the (single) shard
    ex = unchanged_export(tmp_path, changed=last)
    result = merge_model(ex.config(tmp_path / "out"))
    manifest = manifest_of(Path(result.output_dir))
    assert manifest[MANIFEST_FIELD] == {"compared_tensors": len(manifest["tensors"]), "differing_tensors": 1}


def test_the_refusal_is_a_one_line_error_in_the_flow(tmp_path: Path, prefect_api: object) -> None:
    ex = unchanged_export(tmp_path)
    with pytest.raises(UnchangedWeightsError, match="pass --allow-unchanged") as info:
        merge_model(ex.config(tmp_path / "out"))
    assert info.value.exit_code == 2 and not info.value.resumable and info.value.staging_dir is None
    assert leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("layout", ["lora_only", "full_state"])
def test_a_lora_adapter_export_is_exempt(tmp_path: Path, prefect_api: object, layout: str) -> None:
    # The adapter is the training: a full-state export writes the frozen (= base) transformer beside it by design.
    ck = build_lora_checkpoint(tmp_path, CLASS, lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS),
                               world_size=1, layout=layout)
    result = merge_model(ck.config(tmp_path / "out"))
    manifests = list(Path(result.output_dir).rglob(MANIFEST_NAME))
    assert manifests and all(MANIFEST_FIELD not in json.loads(m.read_text()) for m in manifests)


def test_a_fused_lora_export_samples_its_fused_weights_and_an_untrained_lora_is_refused(
        tmp_path: Path, prefect_api: object) -> None:
    make = lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=ATTN_TARGETS)  # noqa: E731
    ck = build_lora_checkpoint(tmp_path / "trained", CLASS, make, world_size=1)
    out = Path(merge_model(ck.config(tmp_path / "trained" / "out", fuse_lora=True)).output_dir)
    manifest = manifest_of(out)
    # A LoRA run leaves every frozen weight equal to the base: sampling the first tensor by name (a frozen one)
    # would read the whole base on every fused export. The fused weights are sampled instead, and differ.
    assert MANIFEST_FIELD not in manifest
    fused = frozenset(f"{module}.weight" for module in manifest["lora_fusion"]["fused_modules"])
    names = sorted(manifest["tensors"])
    assert names[0] not in fused  # the old sample would have matched the base
    check = measure_unchanged(out, [("diffusion_pytorch_model.safetensors", names)], ck.base_dir,
                              "diffusion_pytorch_model.safetensors", fused)
    assert check.sampled == check.compared == 1 and check.differing is None

    def untrained(model) -> None:  # noqa: ANN001 - lora_B all zero: the fused weights are the base's
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.zero_()

    zero = build_lora_checkpoint(tmp_path / "zero", CLASS, make, world_size=1, mutate=untrained)
    with pytest.raises(UnchangedWeightsError, match="pass --allow-unchanged"):
        merge_model(zero.config(tmp_path / "zero" / "out", fuse_lora=True))
    assert not (tmp_path / "zero" / "out").exists()
