"""LoRA adapter export through the real merge flow: real PEFT adapters, real FSDP2 rank files, both layouts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import diffusers
import pytest
import torch
from builders import assert_bit_exact, leftovers, output_state
from lora_builders import ATTN_TARGETS, LoraCheckpoint, build_lora_checkpoint
from peft import LoraConfig, PeftModel
from safetensors import safe_open

from mergeflow import merge_model, validate_artifact
from mergeflow.demo.checkpoints import run_tiny_forward
from mergeflow.errors import ArtifactInvalidError, LoraError, UsageError
from mergeflow.lora.export import DIFFUSERS_METADATA_KEY

# PEFT and Diffusers warn about tiny models (unmatched patterns, adapter dtype casts); huggingface_hub's LFS PUT
# passes a file object as `data=`, which httpx deprecates.
pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning", "ignore::RuntimeWarning", "ignore:Use 'content=<...>' to upload raw bytes:DeprecationWarning"
)

EXTRA_TARGETS = {
    "WanTransformer3DModel": ["patch_embedding"],  # conv LoRA (Conv3d)
    "SD3Transformer2DModel": ["proj"],  # pos_embed.proj, a Conv2d
    "QwenImageTransformer2DModel": ["add_q_proj"],
    "FluxTransformer2DModel": ["proj_mlp"],
}

# class, layout, world size, PeftModel-wrapped keys, exported adapter
CASES = [
    ("FluxTransformer2DModel", "lora_only", 3, True, "default"),
    ("WanTransformer3DModel", "lora_only", 1, False, "default"),
    ("SD3Transformer2DModel", "full_state", 3, False, "old"),
    ("QwenImageTransformer2DModel", "full_state", 1, True, "default"),
]


def plain_config(class_name: str, saved: list[str] | None = None):  # noqa: ANN201
    targets = ATTN_TARGETS + EXTRA_TARGETS[class_name]
    return lambda name: LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=saved)


# QwenImage also trains `proj_out` as a PEFT modules_to_save copy: exported with the adapter, not in the base.
SAVED = {"QwenImageTransformer2DModel": ["proj_out"]}


def perturb_saved(model: PeftModel) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(0.05)


def load_base(ck: LoraCheckpoint) -> torch.nn.Module:
    return getattr(diffusers, ck.class_name).from_pretrained(ck.base_dir, local_files_only=True)


def assert_reproduces(ck: LoraCheckpoint, adapter: str, model: torch.nn.Module) -> None:
    expected = ck.forward(adapter)
    got = run_tiny_forward(model.eval())
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def assert_no_local_paths(out: Path, tmp: Path) -> None:
    for path in out.rglob("*.json"):
        assert str(tmp) not in path.read_text(), path


@pytest.mark.parametrize("class_name,layout,world_size,wrapped,adapter", CASES, ids=[f"{c[0][:5]}-{c[1]}-w{c[2]}" for c in CASES])
def test_exported_adapter_loads_in_peft_and_reproduces_the_trained_forward(
    tmp_path: Path, prefect_api: object, class_name: str, layout: str, world_size: int, wrapped: bool, adapter: str
) -> None:
    saved = SAVED.get(class_name)
    ck = build_lora_checkpoint(tmp_path, class_name, plain_config(class_name, saved), world_size=world_size,
                               layout=layout, wrapped=wrapped, mutate=perturb_saved if saved else None)
    # A LoRA-only adapter needs no local base: a Hub id that does not exist here is enough.
    base_model = "tiny-org/tiny-base" if layout == "lora_only" else str(ck.base_dir)
    result = merge_model(ck.config(tmp_path / "out", base_model=base_model, adapter_name=adapter))
    out = Path(result.output_dir)
    assert not leftovers(tmp_path, ".out")
    adapter_dir = out / "lora_adapter"
    assert sorted(os.listdir(adapter_dir)) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                               "merge_manifest.json", "merge_manifest.sha256"]
    manifest = json.loads((adapter_dir / "merge_manifest.json").read_text())
    assert manifest["artifact_type"] == "peft_adapter" and manifest["architecture"] == class_name
    assert manifest["lora_adapter"]["excluded_adapters"] == sorted({"default", "old"} - {adapter})
    assert "lora_train_meta.json" in manifest["source_files"]
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["task_type"] is None  # alpha from the metadata
    assert config["target_modules"] == sorted(set(plain_config(class_name)("default").target_modules))
    if saved:
        assert config["modules_to_save"] == ["proj_out"]
        with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
            assert "base_model.model.proj_out.weight" in set(handle.keys())
    if layout == "lora_only":
        assert os.listdir(out) == ["lora_adapter"]
        assert result.manifest_path == str(adapter_dir / "merge_manifest.json")
        assert config["base_model_name_or_path"] == "tiny-org/tiny-base"
    else:
        # the frozen weights, adapters stripped and `.base_layer.` collapsed: exactly the base model
        assert_bit_exact(load_base(ck).state_dict(), output_state(out))
        root = json.loads(Path(result.manifest_path).read_text())
        assert {"lora_adapter/adapter_config.json", "lora_adapter/merge_manifest.json"} <= set(root["files"])
        assert "lora_fusion" not in root and "lora_train_meta.json" in root["source_files"]
        assert config["base_model_name_or_path"] == ck.base_dir.name  # a local base: its name, never its path
    assert_no_local_paths(out, tmp_path)
    loaded = PeftModel.from_pretrained(load_base(ck), adapter_dir)
    assert_reproduces(ck, adapter, loaded.base_model.model)
    assert validate_artifact(out) == {"integrity": "passed", "architecture": class_name}
    assert validate_artifact(adapter_dir) == {"integrity": "passed", "architecture": class_name}


@pytest.fixture(scope="module")
def flux_lora_only(tmp_path_factory: pytest.TempPathFactory) -> LoraCheckpoint:
    root = tmp_path_factory.mktemp("flux-lora-only")
    return build_lora_checkpoint(root, "FluxTransformer2DModel", plain_config("FluxTransformer2DModel"), world_size=3,
                                 layout="lora_only")


def test_diffusers_format_keeps_alpha_and_loads_with_load_lora_adapter(
    tmp_path: Path, prefect_api: object, flux_lora_only: LoraCheckpoint
) -> None:
    ck = flux_lora_only
    result = merge_model(ck.config(tmp_path / "out", base_model="tiny-org/flux", adapter_name="old",
                                   adapter_format="diffusers"))
    adapter_dir = Path(result.output_dir) / "lora_adapter"
    assert sorted(os.listdir(adapter_dir)) == ["README.md", "merge_manifest.json", "merge_manifest.sha256",
                                               "pytorch_lora_weights.safetensors"]
    weights = adapter_dir / "pytorch_lora_weights.safetensors"
    with safe_open(str(weights), framework="pt") as handle:
        keys = set(handle.keys())
        packed = json.loads(handle.metadata()[DIFFUSERS_METADATA_KEY])
    assert "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight" in keys
    assert all(k.startswith("transformer.") and ".old." not in k for k in keys)
    assert packed["transformer.lora_alpha"] == 8 and packed["transformer.r"] == 4
    model = load_base(ck)
    model.load_lora_adapter(str(adapter_dir), weight_name=weights.name, prefix="transformer", adapter_name="x")
    assert model.get_submodule("transformer_blocks.0.attn.to_q").scaling["x"] == 8 / 4
    assert_reproduces(ck, "old", model)
    assert validate_artifact(Path(result.output_dir))["integrity"] == "passed"


def test_adapter_test_command_is_exact(tmp_path: Path, prefect_api: object, flux_lora_only: LoraCheckpoint) -> None:
    out = Path(merge_model(flux_lora_only.config(tmp_path / "out", base_model="tiny-org/flux")).output_dir)
    import shutil

    stray = tmp_path / "stray"
    shutil.copytree(out, stray)
    (stray / "notes.txt").write_text("x")
    with pytest.raises(ArtifactInvalidError, match="notes.txt"):
        validate_artifact(stray)
    inner = tmp_path / "inner"
    shutil.copytree(out, inner)
    (inner / "lora_adapter" / "extra.bin").write_bytes(b"x")
    with pytest.raises(ArtifactInvalidError, match="not in the manifest"):
        validate_artifact(inner)
    flipped = tmp_path / "flipped"
    shutil.copytree(out, flipped)
    config = flipped / "lora_adapter" / "adapter_config.json"
    config.write_text(config.read_text().replace('"lora_alpha": 8', '"lora_alpha": 9'))
    with pytest.raises(ArtifactInvalidError):
        validate_artifact(flipped)


VARIANTS = {
    # DoRA with rsLoRA and per-module rank / alpha patterns, LoRA-only, W=3
    "dora-rslora-patterns": (
        "lora_only", 3,
        lambda name: LoraConfig(r=4, lora_alpha=8, use_dora=True, use_rslora=True, target_modules=["to_q", "to_k", "proj_mlp"],
                                rank_pattern={"to_k": 2}, alpha_pattern={"proj_mlp": 5}),
    ),
    # lora_B biases, full state, W=1
    "lora-bias": ("full_state", 1, lambda name: LoraConfig(r=4, lora_alpha=8, lora_bias=True, target_modules=["to_q", "to_out.0"])),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_adapters_need_their_config_and_then_reproduce(tmp_path: Path, prefect_api: object, variant: str) -> None:
    layout, world_size, make = VARIANTS[variant]
    ck = build_lora_checkpoint(tmp_path, "FluxTransformer2DModel", make, world_size=world_size, layout=layout)
    # lora_train_meta.json alone cannot say DoRA / lora_bias / patterns: refused, saying what is missing
    with pytest.raises(LoraError, match="adapter_config.json .*--adapter-config"):
        merge_model(ck.config(tmp_path / "refused", base_model=str(ck.base_dir)))
    assert not leftovers(tmp_path, "refused")
    ck.peft.peft_config["default"].save_pretrained(str(tmp_path / "cfg"))
    result = merge_model(ck.config(tmp_path / "out", base_model=str(ck.base_dir),
                                   adapter_config=str(tmp_path / "cfg" / "adapter_config.json")))
    adapter_dir = Path(result.output_dir) / "lora_adapter"
    loaded = PeftModel.from_pretrained(load_base(ck), adapter_dir)
    assert_reproduces(ck, "default", loaded.base_model.model)
    manifest = json.loads((adapter_dir / "merge_manifest.json").read_text())
    assert manifest["lora_adapter"]["settings_source"] == "--adapter-config"


def test_lora_only_base_must_be_local_or_a_hub_id(tmp_path: Path, prefect_api: object, flux_lora_only: LoraCheckpoint) -> None:
    for base in ("./no/such/base", "no-such-dir"):
        with pytest.raises(UsageError, match="neither a local directory nor a Hub id like ORG/NAME"):
            merge_model(flux_lora_only.config(tmp_path / "out", base_model=base))
        assert not leftovers(tmp_path, "out")


def test_adapter_only_upload_publishes_the_adapter_directory(
    tmp_path: Path, prefect_api: object, flux_lora_only: LoraCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hub_server import LocalHubServer
    from huggingface_hub import constants
    from huggingface_hub.utils import close_session

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite runs offline; this server is local
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "LocalOnly0Token" * 2)
    with LocalHubServer() as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.base_url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.base_url + "/{repo_id}/resolve/{revision}/{filename}")
        result = merge_model(flux_lora_only.config(tmp_path / "out", base_model="tiny-org/flux",
                                                   hf_upload_path="tiny-org/flux-lora"))
        stored = hub.files("tiny-org/flux-lora")
    close_session()
    assert result.upload is not None and result.upload["status"] == "uploaded", result.upload
    # the Hub repo is the adapter directory itself: PEFT loads it by repo id
    adapter_dir = Path(result.output_dir) / "lora_adapter"
    assert set(stored) - {".gitattributes"} == set(os.listdir(adapter_dir))
    assert stored["adapter_config.json"].content == (adapter_dir / "adapter_config.json").read_bytes()


def test_full_state_pipeline_export_with_diffusers_adapter_loads_with_load_lora_weights(tmp_path: Path, prefect_api: object) -> None:
    from fixtures.pipelines_image import build_flux_pipeline

    class_name = "FluxTransformer2DModel"
    ck = build_lora_checkpoint(tmp_path, class_name, plain_config(class_name), world_size=3)
    pipeline_base = build_flux_pipeline(tmp_path / "pipeline-base", load_base(ck))
    result = merge_model(ck.config(tmp_path / "out", base_model=str(pipeline_base), output_format="pipeline",
                                   adapter_format="diffusers"))
    out = Path(result.output_dir)
    manifest = json.loads(Path(result.manifest_path).read_text())
    assert manifest["artifact_type"] == "diffusers_pipeline" and manifest["tensor_directory"] == "transformer"
    assert {"lora_adapter/pytorch_lora_weights.safetensors", "lora_adapter/merge_manifest.json"} <= set(manifest["files"])
    assert_bit_exact(load_base(ck).state_dict(), output_state(out / "transformer"))
    assert validate_artifact(out) == {"integrity": "passed", "architecture": "FluxPipeline"}
    pipe = diffusers.FluxPipeline.from_pretrained(out, local_files_only=True)
    pipe.load_lora_weights(str(out / "lora_adapter"), weight_name="pytorch_lora_weights.safetensors", adapter_name="x")
    assert_reproduces(ck, "default", pipe.transformer)
